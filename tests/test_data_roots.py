"""One data-root rule and `owai data` (issue #25 item 1, issue #26 --data-root): list, fetch (against
a local HTTP server, never the network), verify, and the one-line error of every data-reading
command when its dataset is missing, with no run directory left behind."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cli_in_process

from owai.data import mnist as mn
from owai.data import registry
from owai.errors import OwaiError

MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def _listing(capsys, *extra: str) -> dict[str, dict[str, str]]:
    code, out, err = cli_in_process(["data", "list", "--json", *extra], capsys)
    assert code == 0, err
    return {row["name"]: row for row in json.loads(out)}


def test_list_on_a_clean_machine_and_with_owai_data(capsys, monkeypatch, no_data, shared_data):
    monkeypatch.delenv("OWAI_DATA")
    clean = _listing(capsys)
    assert set(clean) >= {"mnist", "camelyon17", "pacs", "vlcs", "office_home", "terra_incognita", "babistories",
                          "tinystories", "wikipedia"}
    assert all(row["found"] == "no" for row in clean.values())
    assert str(no_data / "data" / "mnist") in clean["mnist"]["where"] and "owai data fetch mnist" in clean["mnist"]["get"]
    assert "domainbed.scripts.download" in clean["pacs"]["get"]
    monkeypatch.setenv("OWAI_DATA", str(shared_data))
    found = _listing(capsys)
    assert found["mnist"]["found"] == "yes" and found["mnist"]["verified"] == "yes"
    assert found["mnist"]["where"] == str(shared_data / "mnist")
    assert found["camelyon17"]["found"] == "no"


def test_lookup_order_explicit_then_owai_data_then_cache(monkeypatch, no_data, tmp_path):
    def mnist_at(folder: Path) -> Path:
        folder.mkdir(parents=True)
        for f in mn.PACKAGED_DIR.glob("t10k-*"):
            (folder / f.name).write_bytes(f.read_bytes())
        return folder

    test_only = mn.split_files("test")
    cached = mnist_at(no_data / "data" / "mnist")
    assert registry.locate("mnist", required=test_only) == cached
    env = mnist_at(tmp_path / "env" / "mnist")
    monkeypatch.setenv("OWAI_DATA", str(tmp_path / "env"))
    assert registry.locate("mnist", required=test_only) == env
    explicit = mnist_at(tmp_path / "flag" / "mnist")
    assert registry.locate("mnist", tmp_path / "flag", test_only) == explicit
    assert registry.locate("mnist", explicit, test_only) == explicit  # the dataset's own folder works too
    with pytest.raises(OwaiError, match=r"not found in .*nowhere; run `owai data fetch mnist --data-root"):
        registry.require("mnist", tmp_path / "nowhere", test_only)  # an explicit root is authoritative
    (tmp_path / "env" / "mnist" / "t10k-labels-idx1-ubyte.gz").unlink()  # incomplete: skipped
    assert registry.locate("mnist", required=test_only) == cached


def test_owai_code_does_not_look_for_shared():
    root = Path(mn.__file__).resolve().parents[1]
    offenders = [str(p) for p in root.rglob("*.py") if "../shared" in p.read_text() or '"shared"' in p.read_text()]
    assert offenders == []


# -- fetch against a local server ------------------------------------------------------------------


@pytest.fixture
def fake_mnist(monkeypatch, tmp_path) -> dict[str, bytes]:
    """Small stand-ins for the four official files, with their md5 published in OFFICIAL_MD5."""
    files = {name: gzip.compress(f"fake {name}".encode(), mtime=0) for name in MNIST_FILES}
    digests = {name: hashlib.md5(data).hexdigest() for name, data in files.items()}  # noqa: S324
    monkeypatch.setattr(mn, "OFFICIAL_MD5", digests)
    return files


@pytest.fixture
def server(tmp_path) -> Iterator[tuple[str, Path]]:
    """An HTTP server on 127.0.0.1 serving tmp_path/www: (base URL, its folder)."""
    www = tmp_path / "www"
    www.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(www), **kwargs)

        def log_message(self, *args):  # no request lines on stderr
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", www
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_fetch_mnist_from_a_mirror_then_verify(capsys, monkeypatch, no_data, fake_mnist, server):
    url, www = server
    (www / "good").mkdir()
    for name, data in fake_mnist.items():
        (www / "good" / name).write_bytes(data)
    monkeypatch.setenv(registry.MNIST_MIRROR_ENV, f"{url}missing/,{url}good/")  # the first mirror 404s
    code, out, err = cli_in_process(["data", "fetch", "mnist", "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    folder = no_data / "data" / "mnist"
    assert report["path"] == str(folder) and len(report["verified"]) == 4
    assert sorted(p.name for p in folder.iterdir()) == sorted(MNIST_FILES)
    code, out, err = cli_in_process(["data", "verify", "mnist"], capsys)
    assert code == 0 and "md5" in out, err
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(b"corrupted")
    code, out, err = cli_in_process(["data", "verify", "mnist"], capsys)
    assert code == 2 and "t10k-labels-idx1-ubyte.gz has md5" in err and len(err.strip().splitlines()) == 1


def test_a_corrupted_download_is_refused_and_leaves_nothing(capsys, no_data, fake_mnist, server, tmp_path):
    url, www = server
    for name, data in fake_mnist.items():
        (www / name).write_bytes(data if "labels" not in name else b"tampered")
    root = tmp_path / "root"
    code, _, err = cli_in_process(["data", "fetch", "mnist", "--data-root", str(root), "--mirror", url], capsys)
    *progress, error = err.strip().splitlines()  # the "downloading ..." lines (stderr), then one error line
    assert code == 2 and "refused" in error and error.startswith("error:") and not any("error" in p for p in progress)
    assert list(root.iterdir()) == []  # neither the folder nor a temporary file
    assert not (no_data / "data").exists()


def test_manual_datasets_name_their_step(capsys, no_data):
    code, _, err = cli_in_process(["data", "fetch", "terraincognita"], capsys)
    assert code == 2 and "domainbed.scripts.download" in err
    code, _, err = cli_in_process(["data", "fetch", "babistories"], capsys)
    assert code == 2 and "MemoryMosaics" in err
    code, _, err = cli_in_process(["data", "verify", "nosuchset"], capsys)
    assert code == 2 and "unknown dataset" in err


# -- every data-reading command: one line, no run directory ----------------------------------------


def _fails_cleanly(capsys, args: list[str], out: Path, expected: str) -> None:
    code, _, err = cli_in_process([*args, "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert expected in lines[0], lines[0]
    assert not out.exists(), "a run directory was created"


@pytest.mark.parametrize("args, expected", [
    (["bonsai", "--data-root", "{empty}"], "owai data fetch mnist --data-root"),
    (["bonsai"], "owai data fetch mnist` (or --preset tiny"),  # the cpu preset reads the 60k split
    (["bonsai", "--recipe", "table2.5-pi", "--study"], "owai data fetch mnist` (or --preset tiny"),
    (["dropout-ft"], "owai data fetch mnist` (pretrain.source=mnist-train; or --preset tiny"),
    (["bonsai", "--dataset", "camelyon17"], "owai data fetch camelyon17"),
    (["bonsai", "--dataset", "camelyon17", "--study", "--data-root", "{empty}"], "owai data fetch camelyon17 --data-root"),
    (["dropout-ft", "--dataset", "pacs"], "domainbed.scripts.download"),
    (["dropout-ft", "--dataset", "vlcs", "--root", "{empty}"], "domainbed.scripts.download"),
    (["mosaic-train", "--dataset", "babistories"], "MemoryMosaics"),
    (["mosaic-train", "--dataset", "tinystories", "--data-root", "{empty}"], "owai data fetch tinystories --data-root"),
    (["mosaic-eval", "{model}", "--dataset", "babistories"], "MemoryMosaics"),
    (["eval", "posloss", "{model}", "--dataset", "wikipedia", "--data-root", "{empty}"], "owai data fetch wikipedia --data-root"),
])
def test_missing_dataset_is_one_line_and_no_run_dir(capsys, no_data, tmp_path, args, expected):
    (tmp_path / "empty").mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "owai_mm"}))
    args = [a.format(empty=tmp_path / "empty", model=model) for a in args]
    _fails_cleanly(capsys, args, tmp_path / "runs", expected)


@pytest.mark.parametrize("value, says", [("a-file", "is a file, not a folder"), ("nowhere", "does not exist")])
@pytest.mark.parametrize("args", [["mosaic-train", "--size", "tiny"], ["eval", "icl", "--task", "banking77", "--model", "reference:knn"]])
def test_owai_data_that_names_no_folder_is_said_so(capsys, no_data, tmp_path, monkeypatch, value, says, args):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("OWAI_DATA", str(tmp_path / value))
    _fails_cleanly(capsys, args, tmp_path / "runs", f"$OWAI_DATA={tmp_path / value} {says}")


def test_recipes_show_resolves_without_the_data(capsys, no_data):
    """`owai recipes show` prints a valid config whose data are not here, with the missing piece
    named; a bad value is still an error (CannotRunHere, DataMissing among it, is the only exception it tolerates)."""
    code, out, err = cli_in_process(["recipes", "show", "table2.4-coloredmnist", "-p", "cpu"], capsys)
    assert code == 0, err
    assert "split: paper" in out and "# not runnable on this machine yet: MNIST" in out
    code, out, err = cli_in_process(["recipes", "show", "table2.4-coloredmnist", "-p", "tiny"], capsys)
    assert code == 0 and "not runnable" not in out
    code, _, err = cli_in_process(["recipes", "show", "table2.4-coloredmnist", "--set", "train.steps=0"], capsys)
    assert code == 2 and "train.steps" in err



@pytest.mark.parametrize("recipe, preset, given", [("mosaic-eval", "cpu", "models=[runs/x]"), ("fig4.6-icl", "paper", "model=runs/x"),
                                                   ("table4.4-ruler", "paper", "model=runs/x")])
def test_recipes_show_a_recipe_whose_model_is_given_at_run_time(capsys, recipe, preset, given):
    """The evaluation recipes leave the model to the command line: `recipes show` prints them with
    that named as what is missing (it refused mosaic-eval outright); a run without it is refused."""
    code, out, err = cli_in_process(["recipes", "show", recipe, "-p", preset], capsys)
    assert code == 0, err
    assert "# not runnable on this machine yet: no model given" in out
    code, _, err = cli_in_process(["recipes", "run", recipe, "-p", preset], capsys)
    assert code == 2 and err.startswith("error: no model given") and err.count("\n") == 1
    code, out, err = cli_in_process(["recipes", "show", recipe, "-p", preset, "--set", given], capsys)
    assert code == 0 and "no model given" not in out, err


def test_generated_data_recipes_refuse_the_flag(capsys, tmp_path):
    code, _, err = cli_in_process(["bonsai", "--recipe", "figA.2-twobits", "--data-root", str(tmp_path)], capsys)
    assert code == 2 and "reads no dataset" in err


def test_data_root_reaches_the_runs_config(capsys, tmp_path, shared_data, monkeypatch):
    """`--data-root` is recorded as data.root (absolute), so sweep points and resumes read the same data."""
    from owai.commands._common import data_root_sets

    assert data_root_sets(shared_data, "table2.4-coloredmnist") == [f"data.root={shared_data.resolve()}"]
    monkeypatch.chdir(shared_data)
    assert data_root_sets(Path("."), "table2.8-dropout") == [f"data.root={shared_data.resolve()}"]


def test_text_corpora_follow_the_rule(monkeypatch, no_data, tmp_path):
    from owai.data.text import open_source, resolve_source

    assert resolve_source("tinystories") == "roneneldan/TinyStories"  # no local copy: the hub id
    assert resolve_source("owai-stories:40") == "owai-stories:40"
    stories = no_data / "data" / "text" / "tinystories"
    stories.mkdir(parents=True)
    for split in ("train", "valid"):
        (stories / f"TinyStoriesV2-GPT4-{split}.txt").write_text(f"A {split} story.\n<|endoftext|>\nAnother.\n")
    assert resolve_source("tinystories") == str(stories)  # the cache copy
    (tmp_path / "d" / "text").mkdir(parents=True)
    (tmp_path / "d" / "text" / "essays.txt").write_text("One essay.\n\nTwo essays.\n")
    monkeypatch.setenv("OWAI_DATA", str(tmp_path / "d"))
    assert resolve_source("text/essays.txt") == str(tmp_path / "d" / "text" / "essays.txt")  # relative to $OWAI_DATA
    assert list(open_source("text/essays.txt").texts("train"))
    monkeypatch.setenv("OWAI_BABISTORIES", str(stories))  # the legacy variable is an alias
    assert resolve_source("babistories") == str(stories)


def test_fetch_the_real_files_with_the_official_checksums(capsys, monkeypatch, no_data, shared_data, server):
    """The shared copy served as a mirror: t10k matches the official .gz md5, the re-compressed
    training files match the official md5 of their content; the result loads as 60k + 10k."""
    monkeypatch.delenv("OWAI_DATA")
    url, www = server
    for name in MNIST_FILES:
        (www / name).symlink_to(shared_data / "mnist" / name)
    code, out, err = cli_in_process(["data", "fetch", "mnist", "--mirror", url, "--json"], capsys)
    assert code == 0, err
    assert any("content md5" in line for line in json.loads(out)["verified"])
    assert len(mn.load_mnist("train")) == 60_000 and mn.mnist_dir("test") == no_data / "data" / "mnist"


def test_recipes_show_a_preset_too_large_for_this_machine(capsys, monkeypatch):
    """The paper presets of chapter 4 need GPUs: `recipes show` prints their settings, the memory
    refusal named as what stands in the way, and --json stays one JSON document."""
    import owai.plan

    monkeypatch.setattr(owai.plan, "device_capacity", lambda device: (23.5 * 2**30, "CPU RAM"))  # a laptop's, on any host
    code, out, err = cli_in_process(["recipes", "show", "table4.2-pretrain", "-p", "paper"], capsys)
    assert code == 0, err
    assert "# not runnable on this machine yet: Memory Mosaics v2 large needs 173.3 GiB per rank (1 process) but a rank here has 23.5 GiB" in out
    code, out, err = cli_in_process(["recipes", "show", "table4.2-pretrain", "-p", "paper", "--json"], capsys)
    resolved = json.loads(out)["resolved"]
    assert code == 0 and resolved["params"]["data"]["stream"] is True and "GiB per rank" in resolved["missing"]
