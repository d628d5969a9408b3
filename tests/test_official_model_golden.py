"""The official code's outputs, recorded once, so that the default run (which has no clone of the
official code) still checks owai against them, on the weights, inputs and settings of
tests/test_official_code.py's parity tests:

- models: Memory Mosaics v1 (the Library's `StackAssoMem`, nanoMosaics' `MemoryMosaic`), the GPT
  baselines (the Library's baseline GPT, nanoMosaics' gpt_model.py) and the RegBench transformer
  and LSTM (seq_icl's `lm_simple`, `lm_simple_noffn`): logits and every gradient, in float64; the
  Library's eft model (its CUDA kernel as the formula) and ICLL's RegBench plug-in: logits;
- whole training runs: RFC's ColoredMNIST trainers, PI.py and Bonsai against `owai bonsai`, the
  Library's and nanoMosaics' training loops against `owai mosaic-train`, the Three Moons code's MLX
  loop against `owai moons`: the weights each run ends at (and the Three Moons error curves);
- RFC's Camelyon17 objectives (ERM, IRM, VREX, GroupDRO of the discovery rounds, WILDS's loss) against
  owai's: each step's loss and its gradient on the logits;
- seq_icl's RegBench scores (its dfa accuracy, model-to-automaton distance, 3-gram distance) against
  owai's metrics on one batch.

Recorded on 2026-12-01 from the OFFICIAL code's output, not owai's: facebookresearch/MemoryMosaics at
1fff63b, TjuJianyu/RFC at de4a5a4 and berlino/seq_icl at 9b9223d, each built, loaded and run exactly as
tests/test_official_code.py does (its tests run with `_agree`, `_assert_same_weights`, `pytest.approx`
and `torch.testing.assert_close` wrapped by recorders of the reference's side; those tests passed as
they recorded). What is kept:
- `GOLDEN[case]["logits"]`: the reference's logits flattened, times 8 random directions (float64
  N(0, 1), generator seed 0, one column per direction); `loss`: its cross-entropy on the test's
  targets; `params`: for each reference parameter, its name, size, values and gradient of that loss
  each dotted with one random direction (N(0, 1), seed = the size), and the gradient's largest magnitude;
- `TRAINED[label]`: for each weight of the reference run's final model (under owai's names), its size,
  its values dotted with that direction, and its largest magnitude;
- `CAMELYON[case]`: each step's loss, its gradient on the logits dotted with that direction and the
  gradient's largest magnitude (and GroupDRO's group weights, whole).
owai's parameters are matched to the reference's by their values, as test_official_code's
`_same_gradients` matches them (the converter only reshapes). The bounds are that file's element-wise
ones (logits 1e-10, a sharp head's past the clamp 1e-6 / 1e-8, the plug-in's 1e-7; gradients 1e-9 of their scale;
trained weights 1e-9, the language-model loops 1e-10, Three Moons 1e-5) carried through the
projection (times 6 sqrt(size)). Where the clones are present, test_official_code.py compares element
by element; a case here that stops matching means owai changed, and that file says where.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import owai.methods.three_moons as owai_moons
from owai.checkpoint import latest_checkpoint, load_checkpoint
from owai.experiment import execute
from owai.methods.regbench import Config as RegBenchConfig
from owai.methods.regbench import build_model as build_regbench_model
from owai.methods.regbench import max_input_length as regbench_max_input_length
from owai.models.gpt import GPTConfig, GPTForCausalLM
from owai.models.memory_mosaics_convert import convert_official_state_dict
from naive_memory_mosaics import random_official_state_dict
from test_official_code import (C, CAMELYON_ANNEAL, H, IDS, LAYERS, P, PI_SETTINGS, RECIPE, T, TARGETS, TRAINERS, V, _owai_model,
                                _randomised, bonsai_settings, camelyon_batch, group_dro_batches, lm_settings, moon_settings,
                                official_lm_builder, regbench_scoring_batch, trainer_settings)

N_PROBES = 8

GOLDEN = {
    'library bias=False pre_ln=True attn_only=False sharp=False': {
        'logits': [58.0960364970817, -57.3712835907492, -31.1418198274211, 58.3263438840255,
                   -38.3021115321359, -29.1986755739388, 0.103969831480782, -17.5056482265632],
        'loss': 4.12895294971713,
        'params': [
            ('emb.weight', 1952, -19.0633769426037, -0.305406678095278, 0.474078949697969),
            ('blocks.0.ln1.weight', 32, -0.538403895796379, -0.0128554684171079, 0.186904346691055),
            ('blocks.0.attn.leaky_key_beta', 4, -0.138350451447698, 6.26136261536494, 7.53147685976353),
            ('blocks.0.attn.kernel_beta', 4, 0.0658176807284034, 0.132854101006231, 0.117385374369526),
            ('blocks.0.attn.value_beta', 4, -0.0381453957363239, -0.151257770384509, 0.180138303771343),
            ('blocks.0.attn.k_featurizer.conv.weight', 1024, -0.422607555021114, -3.65688735411583, 0.422698229025109),
            ('blocks.0.attn.v_featurizer.coef', 4, 0.688707062283355, -0.0306793847480545, 0.0371435395858081),
            ('blocks.0.attn.v_featurizer.linear.weight', 1024, 5.17196348412768, -0.254988262958753, 0.102112227854035),
            ('blocks.0.attn.c_proj.weight', 1024, 8.16584778074633, 0.0564009374044507, 0.130180865476431),
            ('blocks.0.ln2.weight', 32, -0.843963238957689, 0.117621826387323, 0.0349071810489766),
            ('blocks.0.pmem.leaky_key_beta', 4, -0.36831902236727, -0.228307236989165, 0.137253397960567),
            ('blocks.0.pmem.kernel_beta', 4, -0.307394490115108, 0.000182543726795946, 0.0629377095062353),
            ('blocks.0.pmem.value_beta', 4, 0.0464333022084933, 0.195340102216092, 0.128344473770125),
            ('blocks.0.pmem.pmem.M_k0', 768, -13.9463657774848, 0.136549276440549, 0.0681962755858097),
            ('blocks.0.pmem.pmem.M_v0', 768, 6.6019235265648, 0.0196537497399911, 0.0166107752749956),
            ('blocks.0.pmem.k_featurizer.conv.weight', 1024, 3.68256236976989, 0.0845277185381799, 0.0861676934823012),
            ('blocks.0.pmem.c_proj.weight', 1024, -8.68659600818022, 0.0207914577102669, 0.0213237817479874),
            ('blocks.1.ln1.weight', 32, -1.56039731880433, 0.0347173499907352, 0.0234985183481735),
            ('blocks.1.attn.leaky_key_beta', 4, -0.271094791106458, -0.402373522540339, 0.486989736316039),
            ('blocks.1.attn.kernel_beta', 4, 0.27422304716477, -0.1113101236866, 0.0641153980623818),
            ('blocks.1.attn.value_beta', 4, 0.142206023308607, -0.240083596957154, 0.0683469296379206),
            ('blocks.1.attn.k_featurizer.conv.weight', 1024, 1.27877215798225, -0.32070155171911, 0.0460555042343281),
            ('blocks.1.attn.v_featurizer.coef', 4, 1.41747751377824, 0.00936960182369525, 0.00508433592781621),
            ('blocks.1.attn.v_featurizer.linear.weight', 1024, 4.26484298602131, 0.0407990758516552, 0.0096549919686524),
            ('blocks.1.attn.c_proj.weight', 1024, 3.65246295575342, 0.0496069870394303, 0.00961981734838651),
            ('blocks.1.ln2.weight', 32, -1.09711410647198, -0.00266175580466356, 0.00859871958272154),
            ('blocks.1.pmem.leaky_key_beta', 4, 0.798116262561178, -0.0314416267129696, 0.0733261309953151),
            ('blocks.1.pmem.kernel_beta', 4, 0.025733216607721, 0.0887591723025831, 0.0402458418938616),
            ('blocks.1.pmem.value_beta', 4, 0.0641709387332498, 0.0716343598322363, 0.0221732822059),
            ('blocks.1.pmem.pmem.M_k0', 768, 3.90388270611077, -0.00374732175498881, 0.0179066713022693),
            ('blocks.1.pmem.pmem.M_v0', 768, 2.67134083766559, -0.00418951734719681, 0.00207167978783044),
            ('blocks.1.pmem.k_featurizer.conv.weight', 1024, -0.712137770468679, -0.0376187093777794, 0.0221961261926451),
            ('blocks.1.pmem.c_proj.weight', 1024, 3.86674474121519, -0.0131003803399669, 0.00286816289603065),
            ('ln_out.weight', 32, -1.56402822859032, -0.00146897973889053, 0.00407944785330258),
        ],
    },
    'library bias=True pre_ln=True attn_only=False sharp=False': {
        'logits': [13.1635629428541, 10.2375351300443, 2.97678632586351, 37.2587441945617,
                   24.0695747442887, -31.3013611887353, -42.0235242359926, -11.9844840059284],
        'loss': 4.1338963833774,
        'params': [
            ('emb.weight', 1952, -19.0633769426037, -0.435707689642697, 0.0464529868580859),
            ('blocks.0.ln1.weight', 32, -0.538403895796379, -0.035949373983411, 0.0148535487408672),
            ('blocks.0.ln1.bias', 32, 0.480041628210692, 0.031952014171065, 0.0282510296527494),
            ('blocks.0.attn.leaky_key_beta', 4, -1.80714348052183, 0.00150153510234721, 0.00345169268601781),
            ('blocks.0.attn.kernel_beta', 4, -0.0103048482861237, 0.0152631969193433, 0.0587867169279969),
            ('blocks.0.attn.value_beta', 4, 0.0407009401446502, 0.975656186574853, 0.260186503896572),
            ('blocks.0.attn.k_featurizer.conv.weight', 1024, 13.9846575985881, 0.0152815462057033, 0.0203178156391676),
            ('blocks.0.attn.k_featurizer.conv.bias', 32, -0.541200797185379, 0.000770325411547804, 0.00191088395604257),
            ('blocks.0.attn.v_featurizer.coef', 4, 1.17282751151157, 0.108809987474748, 0.0745333047326582),
            ('blocks.0.attn.v_featurizer.linear.weight', 1024, 4.85851657848347, 0.0343700547476399, 0.0256430197412656),
            ('blocks.0.attn.v_featurizer.linear.bias', 32, -0.302016988002798, -0.0528176213450505, 0.0316855262979101),
            ('blocks.0.attn.c_proj.weight', 1024, 2.86485028922112, 0.0530772283521841, 0.0258909743384567),
            ('blocks.0.attn.c_proj.bias', 32, 0.087335033461243, -0.163807269540242, 0.0740384964510363),
            ('blocks.0.ln2.weight', 32, -0.473939319316456, 0.0710380608625491, 0.0230335665271926),
            ('blocks.0.ln2.bias', 32, -0.26216884902636, -0.041428368434547, 0.0166847454454669),
            ('blocks.0.pmem.leaky_key_beta', 4, -1.15769983416067, -0.00753693115463668, 0.0297034526954346),
            ('blocks.0.pmem.kernel_beta', 4, 0.801697331722636, 0.00840681373339516, 0.00531250493102527),
            ('blocks.0.pmem.value_beta', 4, 0.0216054082227302, 0.0530072949352681, 0.0287495094916399),
            ('blocks.0.pmem.pmem.M_k0', 768, -10.369014807931, -0.125670445039523, 0.0350985690036161),
            ('blocks.0.pmem.pmem.M_v0', 768, -1.50545699801338, -0.0019501146467649, 0.00463894144459045),
            ('blocks.0.pmem.k_featurizer.conv.weight', 1024, 8.13626895637162, -0.0640542232127056, 0.0628311760290643),
            ('blocks.0.pmem.k_featurizer.conv.bias', 32, -0.253763445667585, 0.0483388226301665, 0.0353001093655543),
            ('blocks.0.pmem.c_proj.weight', 1024, -2.77524111704769, 0.0137847291302301, 0.00416380327109616),
            ('blocks.0.pmem.c_proj.bias', 32, 0.364236786128055, 0.00851208444384255, 0.0077008071089619),
            ('blocks.1.ln1.weight', 32, -1.02906485207213, -0.000545291208926106, 0.00159782965659206),
            ('blocks.1.ln1.bias', 32, -0.247839353108084, 0.00105040838666121, 0.00214508431706616),
            ('blocks.1.attn.leaky_key_beta', 4, -0.51591662014111, -0.000748121375081012, 0.0016036640301128),
            ('blocks.1.attn.kernel_beta', 4, 0.0583053633637705, -0.0116396034593972, 0.0072267752446081),
            ('blocks.1.attn.value_beta', 4, -0.0899792133613042, -0.0158054846421444, 0.0250111072010037),
            ('blocks.1.attn.k_featurizer.conv.weight', 1024, -2.59499179400411, 0.00824929526158589, 0.00138960741157059),
            ('blocks.1.attn.k_featurizer.conv.bias', 32, -0.988983525500811, 0.000211470416410388, 0.000223170460703761),
            ('blocks.1.attn.v_featurizer.coef', 4, 1.56212840256366, -0.000520071818119701, 0.000873047612631053),
            ('blocks.1.attn.v_featurizer.linear.weight', 1024, -1.74843447056723, -0.018541894016027, 0.00256928118445031),
            ('blocks.1.attn.v_featurizer.linear.bias', 32, 0.335574907430859, 0.00236258886452207, 0.002593456561131),
            ('blocks.1.attn.c_proj.weight', 1024, 0.645853214362953, 0.0343738768633388, 0.00337259142669738),
            ('blocks.1.attn.c_proj.bias', 32, -0.102385790093394, 0.00594393486039913, 0.00885652366019209),
            ('blocks.1.ln2.weight', 32, -0.648603761039041, -0.000429430605576959, 0.00332725663359795),
            ('blocks.1.ln2.bias', 32, -0.104258262058474, 0.00428207047797546, 0.00324086239493323),
            ('blocks.1.pmem.leaky_key_beta', 4, 0.40853970910793, 0.00293688368957749, 0.00151668621183502),
            ('blocks.1.pmem.kernel_beta', 4, 0.0716732025167175, 0.0155066262308781, 0.0284748605943328),
            ('blocks.1.pmem.value_beta', 4, -0.214590299541922, 0.0168777658468988, 0.0263684494587613),
            ('blocks.1.pmem.pmem.M_k0', 768, 10.5913566800762, -0.0128521534117092, 0.00573546005914963),
            ('blocks.1.pmem.pmem.M_v0', 768, 3.61805585043806, -0.00720029786154833, 0.00175985297729506),
            ('blocks.1.pmem.k_featurizer.conv.weight', 1024, 3.99475622326422, -0.043615290163148, 0.00918502518687533),
            ('blocks.1.pmem.k_featurizer.conv.bias', 32, -0.534853003323217, 0.000945537607220036, 0.00576768280770393),
            ('blocks.1.pmem.c_proj.weight', 1024, -4.84850007300198, 0.00249317180239109, 0.00194816671252766),
            ('blocks.1.pmem.c_proj.bias', 32, 0.242491615243696, -0.000560171316356918, 0.0042599102648559),
            ('ln_out.weight', 32, -1.64308209855642, 0.00885129023108984, 0.00318235846096683),
            ('ln_out.bias', 32, 0.0588338950257259, -1.00580503314943e-05, 0.00204166891431141),
        ],
    },
    'library bias=False pre_ln=False attn_only=False sharp=False': {
        'logits': [32.4954612815215, -26.8194773011578, -41.8495314354371, 27.8827051461261,
                   -13.5464699077726, 30.3676652514174, -8.51709994281303, -12.6408197095118],
        'loss': 4.13016426373281,
        'params': [
            ('emb.weight', 1952, -19.0633769426037, -0.467748687120217, 0.0716834474257631),
            ('blocks.0.ln1.weight', 32, -0.538403895796379, -0.0132975942153218, 0.0126899583369814),
            ('blocks.0.attn.leaky_key_beta', 4, -0.138350451447698, -0.614646664931755, 0.706802675152677),
            ('blocks.0.attn.kernel_beta', 4, 0.0658176807284034, 0.0142733405661421, 0.0267165973134151),
            ('blocks.0.attn.value_beta', 4, -0.0381453957363239, 0.00492022783627532, 0.0285641511459673),
            ('blocks.0.attn.k_featurizer.conv.weight', 1024, -0.422607555021114, 0.126494692334692, 0.0485472704072296),
            ('blocks.0.attn.v_featurizer.coef', 4, 0.688707062283355, -0.000811444874411472, 0.00379665880238626),
            ('blocks.0.attn.v_featurizer.linear.weight', 1024, 5.17196348412768, -0.00905009196401561, 0.0054160744447155),
            ('blocks.0.attn.c_proj.weight', 1024, 8.16584778074633, -0.0441380591546132, 0.0061339781587524),
            ('blocks.0.ln2.weight', 32, -0.843963238957689, 0.00789605023096817, 0.0085820634017907),
            ('blocks.0.pmem.leaky_key_beta', 4, -0.36831902236727, -0.0434867356634105, 0.027264527451632),
            ('blocks.0.pmem.kernel_beta', 4, -0.307394490115108, -0.0113875293914787, 0.00687858046604951),
            ('blocks.0.pmem.value_beta', 4, 0.0464333022084933, 0.0553920658889753, 0.0560099962858181),
            ('blocks.0.pmem.pmem.M_k0', 768, -13.9463657774848, 0.0276765697903634, 0.00505057949982981),
            ('blocks.0.pmem.pmem.M_v0', 768, 6.6019235265648, 0.00731096003756623, 0.00423377773280704),
            ('blocks.0.pmem.k_featurizer.conv.weight', 1024, 3.68256236976989, 0.0412394216530024, 0.00611561265319024),
            ('blocks.0.pmem.c_proj.weight', 1024, -8.68659600818022, -0.036906060532994, 0.00384415261060609),
            ('blocks.1.ln1.weight', 32, -1.56039731880433, 0.00868822153811273, 0.0078634169578232),
            ('blocks.1.attn.leaky_key_beta', 4, -0.271094791106458, 0.0857324146716165, 0.0950456436449205),
            ('blocks.1.attn.kernel_beta', 4, 0.27422304716477, 0.0107778440346805, 0.0127792091609853),
            ('blocks.1.attn.value_beta', 4, 0.142206023308607, 0.0159505450254712, 0.0142942498962176),
            ('blocks.1.attn.k_featurizer.conv.weight', 1024, 1.27877215798225, 0.122726180643535, 0.0174088293619027),
            ('blocks.1.attn.v_featurizer.coef', 4, 1.41747751377824, -0.00304711433712702, 0.00271001423251527),
            ('blocks.1.attn.v_featurizer.linear.weight', 1024, 4.26484298602131, -0.0136875079296222, 0.00290100929384088),
            ('blocks.1.attn.c_proj.weight', 1024, 3.65246295575342, -0.000398974356567029, 0.00214056677882826),
            ('blocks.1.ln2.weight', 32, -1.09711410647198, -0.00163172016570534, 0.00639773240984244),
            ('blocks.1.pmem.leaky_key_beta', 4, 0.798116262561178, -0.0151778840164818, 0.00972319819863238),
            ('blocks.1.pmem.kernel_beta', 4, 0.025733216607721, 0.0225133350293378, 0.0121391257435621),
            ('blocks.1.pmem.value_beta', 4, 0.0641709387332498, 0.0277010711635377, 0.011648275970843),
            ('blocks.1.pmem.pmem.M_k0', 768, 3.90388270611077, -0.00995693941450142, 0.00823379615194895),
            ('blocks.1.pmem.pmem.M_v0', 768, 2.67134083766559, 0.0120167593578157, 0.00108824797396398),
            ('blocks.1.pmem.k_featurizer.conv.weight', 1024, -0.712137770468679, -0.0414851175717149, 0.00920961533862469),
            ('blocks.1.pmem.c_proj.weight', 1024, 3.86674474121519, 0.000803129084126147, 0.00193918323634375),
            ('ln_out.weight', 32, -1.56402822859032, -0.00334078556066457, 0.00578298465200343),
        ],
    },
    'library bias=True pre_ln=False attn_only=True sharp=False': {
        'logits': [-31.0297248933322, -0.522535493946417, -64.3195330309506, 32.4884846367471,
                   13.9946110127154, 37.3778789802196, 6.94150770781229, -46.383067760476],
        'loss': 4.13152476695601,
        'params': [
            ('emb.weight', 1952, -19.0633769426037, 0.000213340834667442, 0.00689762569353966),
            ('blocks.0.ln1.weight', 32, -0.538403895796379, -0.00129070275711165, 0.00294296078150092),
            ('blocks.0.ln1.bias', 32, 0.480041628210692, -0.00027401052492145, 0.00218357582357368),
            ('blocks.0.attn.leaky_key_beta', 4, -1.80714348052183, 0.00150209778327506, 0.000643095480293594),
            ('blocks.0.attn.kernel_beta', 4, -0.0103048482861237, 0.0186860889846935, 0.00947275645643682),
            ('blocks.0.attn.value_beta', 4, 0.0407009401446502, 0.0321546455055529, 0.0138308705067858),
            ('blocks.0.attn.k_featurizer.conv.weight', 1024, 13.9846575985881, 0.00332278445998302, 0.00217005879493365),
            ('blocks.0.attn.k_featurizer.conv.bias', 32, -0.541200797185379, -7.67326874834451e-05, 0.000282141635313939),
            ('blocks.0.attn.v_featurizer.coef', 4, -0.763593117186999, -0.00403854711309512, 0.0010798659234153),
            ('blocks.0.attn.v_featurizer.linear.weight', 1024, 8.13626895637162, 0.00597862206851665, 0.000979836849115872),
            ('blocks.0.attn.v_featurizer.linear.bias', 32, -0.253763445667585, -0.00115021272556001, 0.000983249876653594),
            ('blocks.0.attn.c_proj.weight', 1024, 2.86485028922112, -0.000954081574765485, 0.0010470730131577),
            ('blocks.0.attn.c_proj.bias', 32, 0.087335033461243, 0.00202120855605767, 0.00204076694841943),
            ('blocks.1.ln1.weight', 32, -1.64242440909761, -0.0033519387110891, 0.00230268948057706),
            ('blocks.1.ln1.bias', 32, -0.536381331549615, 0.00235092005643156, 0.002501034893636),
            ('blocks.1.attn.leaky_key_beta', 4, -0.42488134183225, 0.00661511702013526, 0.00399302316437897),
            ('blocks.1.attn.kernel_beta', 4, 0.724036550658473, 0.000504605352285368, 0.00302434587482191),
            ('blocks.1.attn.value_beta', 4, -0.337187758697583, 0.0070301661382947, 0.0106012264240091),
            ('blocks.1.attn.k_featurizer.conv.weight', 1024, 4.61572739865491, -0.0261289389848771, 0.00354500518246142),
            ('blocks.1.attn.k_featurizer.conv.bias', 32, 0.483538972893474, -0.00128833833948277, 0.000515546498353656),
            ('blocks.1.attn.v_featurizer.coef', 4, 0.366051551906065, -0.0018731444594753, 0.00209693924099899),
            ('blocks.1.attn.v_featurizer.linear.weight', 1024, -1.24938856614636, 0.0011629541096622, 0.000624407298901769),
            ('blocks.1.attn.v_featurizer.linear.bias', 32, 0.152194114987566, -0.00172830593063041, 0.0011725004272091),
            ('blocks.1.attn.c_proj.weight', 1024, 2.88790081594283, 0.00355290498655862, 0.000651182003459355),
            ('blocks.1.attn.c_proj.bias', 32, -0.26216884902636, 0.00342054257125011, 0.00209052466753492),
            ('ln_out.weight', 32, -1.21517979831729, -0.005066593211261, 0.00446866969733143),
            ('ln_out.bias', 32, 0.330026007081433, 0.00139750436042398, 0.00221111432074611),
        ],
    },
    'library bias=False pre_ln=True attn_only=False sharp=True': {
        'logits': [32.6594651005365, -25.8382088663428, -35.6981620149255, 34.0330737076593,
                   4.23159521953068, 8.82795579594646, 47.0193742494957, 2.69721373718529],
    },
    'nano bias=False sharp=False': {
        'logits': [-160.301449317557, 27.5089829500135, -364.365869105263, 171.780942668064,
                   33.2932963360669, 160.932298952886, 406.465905147572, -48.2777343187549],
        'loss': 4.6730355033522,
        'params': [
            ('mosaic.wte.weight', 1952, -19.0633769426037, -8.60491471440073, 1.47783286920486),
            ('mosaic.h.0.ln_1.weight', 32, -0.538403895796379, -0.829324738474174, 0.537277192405999),
            ('mosaic.h.0.attn.k_featurizer.key_scale', 4, 0.639976384353405, -2.91247716908542, 1.98025934898585),
            ('mosaic.h.0.attn.k_featurizer.W_k.weight', 1024, 13.9846575985881, 5.55824269041679, 1.24647337646112),
            ('mosaic.h.0.attn.k_featurizer.leaky_avg.leaky_key_beta', 4, 0.205464262139125, 2.43202912107043, 0.988076711196302),
            ('mosaic.h.0.attn.v_featurizer.coef', 4, 0.26379467243738, 1.27759662440777, 0.520044675624999),
            ('mosaic.h.0.attn.v_featurizer.val_scale', 4, 0.0235629615145131, -1.88975985536629, 1.00722409230158),
            ('mosaic.h.0.attn.v_featurizer.W_v.weight', 1024, -6.42330755828887, -2.45414283249705, 0.354558757490682),
            ('mosaic.h.0.attn.c_proj.weight', 1024, -0.794609362621312, 2.28312290871159, 0.299584982066499),
            ('mosaic.h.0.ln_2.weight', 32, -0.617624931122429, -0.0160335175707138, 0.120727298482488),
            ('mosaic.h.0.mlp.P_k', 768, -0.550084369667009, 2.22516036635384, 0.285195444700709),
            ('mosaic.h.0.mlp.P_v', 768, -5.10889129118725, 0.192504223677044, 0.168399720433889),
            ('mosaic.h.0.mlp.out_scale', 4, -0.00877288467137417, -2.66080698927506, 1.07007211521986),
            ('mosaic.h.0.mlp.k_featurizer.key_scale', 4, 0.290094437753371, -1.18544037670276, 0.486029406705909),
            ('mosaic.h.0.mlp.k_featurizer.W_k.weight', 1024, -3.23017026414839, 0.339144399573079, 0.370576336920194),
            ('mosaic.h.0.mlp.k_featurizer.leaky_avg.leaky_key_beta', 4, 0.493222172624758, 4.03001461893164, 2.19699167519748),
            ('mosaic.h.0.mlp.c_proj.weight', 1024, 10.4795631339783, 1.4699890597983, 0.140165571929088),
            ('mosaic.h.1.ln_1.weight', 32, -1.56039731880433, -0.256953817104996, 0.114514974085904),
            ('mosaic.h.1.attn.k_featurizer.key_scale', 4, 0.290932973478535, 0.19897766417629, 0.0995358969171693),
            ('mosaic.h.1.attn.k_featurizer.W_k.weight', 1024, 3.24836955543484, 1.4594087144215, 0.254445865082566),
            ('mosaic.h.1.attn.k_featurizer.leaky_avg.leaky_key_beta', 4, 0.429775073468731, 0.693853976644703, 0.380477308586916),
            ('mosaic.h.1.attn.v_featurizer.coef', 4, 0.653911932696276, 0.00344726448200219, 0.0249554285931036),
            ('mosaic.h.1.attn.v_featurizer.val_scale', 4, -0.0786747246956192, -0.110352872780989, 0.379827292033225),
            ('mosaic.h.1.attn.v_featurizer.W_v.weight', 1024, 0.542869353318135, 0.0224603146819609, 0.0391165423862014),
            ('mosaic.h.1.attn.c_proj.weight', 1024, -7.56384371886063, -0.0385096381991119, 0.0479349201792628),
            ('mosaic.h.1.ln_2.weight', 32, -0.920291740470756, -0.0514795493812993, 0.0328857080658025),
            ('mosaic.h.1.mlp.P_k', 768, -6.70226659520985, 0.17366196960827, 0.0809718543207742),
            ('mosaic.h.1.mlp.P_v', 768, -10.41264469939, 0.0640777280909775, 0.0266870746820477),
            ('mosaic.h.1.mlp.out_scale', 4, 0.0555985142275428, -0.433638345144314, 0.471299027064262),
            ('mosaic.h.1.mlp.k_featurizer.key_scale', 4, 0.114280948775099, -0.120062207707846, 0.0387261110545564),
            ('mosaic.h.1.mlp.k_featurizer.W_k.weight', 1024, 2.57778414714473, 0.305302942975349, 0.0818672421916492),
            ('mosaic.h.1.mlp.k_featurizer.leaky_avg.leaky_key_beta', 4, 0.151193763685673, -0.654710817056047, 0.796355113431163),
            ('mosaic.h.1.mlp.c_proj.weight', 1024, -3.75874331749997, 0.0933717286679047, 0.0184508539049101),
            ('mosaic.ln_f.weight', 32, -1.56402822859032, -0.0862201774881095, 0.071297573069704),
        ],
    },
    'nano bias=True sharp=False': {
        'logits': [133.637658687296, 208.594841958595, 50.9599961586992, 289.899668482937,
                   88.7579508638749, -3.10101933859238, 136.088076512191, 143.189344186365],
        'loss': 4.66611397957355,
        'params': [
            ('mosaic.wte.weight', 1952, -19.0633769426037, -0.24311486550829, 0.986069505769353),
            ('mosaic.h.0.ln_1.weight', 32, -0.538403895796379, 0.715002029725885, 0.375003768647221),
            ('mosaic.h.0.ln_1.bias', 32, 0.480041628210692, 0.489248633751259, 0.2518934426217),
            ('mosaic.h.0.attn.k_featurizer.key_scale', 4, 0.826681533625614, 0.776706190418896, 0.448727596348478),
            ('mosaic.h.0.attn.k_featurizer.W_k.weight', 1024, 4.78862483570662, 9.98337977841176, 0.946687837897606),
            ('mosaic.h.0.attn.k_featurizer.W_k.bias', 32, -0.238328930969493, -0.0705591371023929, 0.429125320827055),
            ('mosaic.h.0.attn.k_featurizer.leaky_avg.leaky_key_beta', 4, -0.351183380545459, -25.903847428068, 17.2500646576115),
            ('mosaic.h.0.attn.v_featurizer.coef', 4, 1.03133485932012, 0.538592527324424, 0.240005406515924),
            ('mosaic.h.0.attn.v_featurizer.val_scale', 4, 0.0681245948515796, 0.408929691146394, 0.256475632158463),
            ('mosaic.h.0.attn.v_featurizer.W_v.weight', 1024, -6.12633844776436, 1.91845150423467, 0.215018498399984),
            ('mosaic.h.0.attn.v_featurizer.W_v.bias', 32, -0.513197748869646, -0.418494605549906, 0.156316861548959),
            ('mosaic.h.0.attn.c_proj.weight', 1024, -11.9364894989178, -0.304784444937913, 0.260243822216072),
            ('mosaic.h.0.attn.c_proj.bias', 32, -0.192784323708542, -0.0814960517464744, 0.458566956458223),
            ('mosaic.h.0.ln_2.weight', 32, -0.619663992581942, -0.123390772614414, 0.148624455258502),
            ('mosaic.h.0.ln_2.bias', 32, -0.0673240326550743, -0.107398133247182, 0.169690103499138),
            ('mosaic.h.0.mlp.P_k', 768, -3.36069186122402, -0.94020924949089, 0.431875730800887),
            ('mosaic.h.0.mlp.P_v', 768, -12.821607264706, 0.373830628822361, 0.0408609895561231),
            ('mosaic.h.0.mlp.out_scale', 4, -0.134681163765272, -1.38744701460689, 0.789467742946665),
            ('mosaic.h.0.mlp.k_featurizer.key_scale', 4, 0.492112960640531, -0.0528536078229354, 0.122975794353014),
            ('mosaic.h.0.mlp.k_featurizer.W_k.weight', 1024, -2.2800634679089, -1.6073682750042, 0.356316027330152),
            ('mosaic.h.0.mlp.k_featurizer.W_k.bias', 32, -0.541001135288297, -0.648849939457144, 0.194165164600681),
            ('mosaic.h.0.mlp.k_featurizer.leaky_avg.leaky_key_beta', 4, -0.323772243339228, 1.34822532946361, 0.639331259280156),
            ('mosaic.h.0.mlp.c_proj.weight', 1024, 4.61572739865491, -0.150449388769543, 0.0396065024724039),
            ('mosaic.h.0.mlp.c_proj.bias', 32, 0.483538972893474, 0.0470911717122936, 0.0793281196932349),
            ('mosaic.h.1.ln_1.weight', 32, -1.02906485207213, -0.0487135785620805, 0.025993589780688),
            ('mosaic.h.1.ln_1.bias', 32, -0.247839353108084, 0.0106948201649214, 0.0137964541900557),
            ('mosaic.h.1.attn.k_featurizer.key_scale', 4, 0.406100019637395, -0.22945415588268, 0.102715397622657),
            ('mosaic.h.1.attn.k_featurizer.W_k.weight', 1024, 7.74019929031113, -0.277238755694834, 0.0836678438060554),
            ('mosaic.h.1.attn.k_featurizer.W_k.bias', 32, -0.460522387857584, -0.0146028834360954, 0.0101824391372413),
            ('mosaic.h.1.attn.k_featurizer.leaky_avg.leaky_key_beta', 4, 0.641938648468327, -0.00476737593086318, 0.032720786559218),
            ('mosaic.h.1.attn.v_featurizer.coef', 4, -0.307580484790954, -0.000941754391199779, 0.0303504856756708),
            ('mosaic.h.1.attn.v_featurizer.val_scale', 4, -0.24548623283212, -0.588276100870967, 0.286757297117232),
            ('mosaic.h.1.attn.v_featurizer.W_v.weight', 1024, -10.3223554468303, 0.234384280296277, 0.0195514144602051),
            ('mosaic.h.1.attn.v_featurizer.W_v.bias', 32, -0.378702350387261, 0.0377705200236156, 0.013755648500329),
            ('mosaic.h.1.attn.c_proj.weight', 1024, -1.01693405725516, 0.0616776498280317, 0.0318596180575608),
            ('mosaic.h.1.attn.c_proj.bias', 32, -1.05196255076935, 0.0733351704601691, 0.0681568063554727),
            ('mosaic.h.1.ln_2.weight', 32, -0.512173564482421, 0.0211831465136049, 0.0172489022455374),
            ('mosaic.h.1.ln_2.bias', 32, 0.529136458657135, -0.0298961963823427, 0.0284352372426444),
            ('mosaic.h.1.mlp.P_k', 768, 2.72800447631511, 0.0685395039327907, 0.049792042066723),
            ('mosaic.h.1.mlp.P_v', 768, 3.33048694463457, -0.0351027707157481, 0.0123170709462237),
            ('mosaic.h.1.mlp.out_scale', 4, 0.0236086078320253, 0.124601506018097, 0.0668071897897236),
            ('mosaic.h.1.mlp.k_featurizer.key_scale', 4, 0.348228735465515, -0.106559307521695, 0.130623879535959),
            ('mosaic.h.1.mlp.k_featurizer.W_k.weight', 1024, -3.35746610646865, 0.641561900409542, 0.0819035202820653),
            ('mosaic.h.1.mlp.k_featurizer.W_k.bias', 32, 0.592393870533566, 0.044268633411952, 0.0446485203837423),
            ('mosaic.h.1.mlp.k_featurizer.leaky_avg.leaky_key_beta', 4, 2.13752003418909, -0.00872006551611768, 0.00468030519866236),
            ('mosaic.h.1.mlp.c_proj.weight', 1024, -11.6223726635338, -0.0507328409598934, 0.0160247195177313),
            ('mosaic.h.1.mlp.c_proj.bias', 32, 0.250779844011066, 0.126543946479867, 0.0717396597984821),
            ('mosaic.ln_f.weight', 32, -1.64308209855642, -0.0136207241386768, 0.101929881451656),
            ('mosaic.ln_f.bias', 32, 0.0588338950257259, 0.0909321104091758, 0.0556133435596951),
        ],
    },
    'nano bias=False sharp=True': {
        'logits': [-168.923632567437, -88.5646505305282, -209.480466153896, 78.8322620859425,
                   -167.59135276237, 3.06746391073657, 124.124086359442, -99.7923337396063],
    },
    'gpt Library bias=False': {
        'logits': [-56.2988959821052, 5.36698553177549, -294.582951948504, 408.4687885032,
                   472.909747816377, -446.241858771528, 204.681074395248, -115.291974067873],
        'loss': 4.55623848469013,
        'params': [
            ('transformer.wte.weight', 1952, 16.8564517721529, -0.561233112245223, 0.0718490317654074),
            ('transformer.wpe.weight', 8192, -4.05302096780408, 0.410034849806496, 0.0234746452306673),
            ('transformer.h.0.ln_1.weight', 32, -1.20222346714525, -0.0707671200293398, 0.0282058445570734),
            ('transformer.h.0.attn.c_attn.weight', 3072, 6.97591474517292, 0.0673185940370602, 0.0355677942282272),
            ('transformer.h.0.attn.c_proj.weight', 1024, 9.74209717258834, -0.216643190519692, 0.0343637816970579),
            ('transformer.h.0.ln_2.weight', 32, -1.37913445678736, -0.0405541041627633, 0.0235675402736189),
            ('transformer.h.0.mlp.c_fc.weight', 4096, 13.5501364348924, -0.188148187272223, 0.0207165016725508),
            ('transformer.h.0.mlp.c_proj.weight', 4096, 0.141115800949695, 0.413370520012121, 0.0633360961144363),
            ('transformer.h.1.ln_1.weight', 32, -0.996006286223066, -0.0300138434881256, 0.0225840503169739),
            ('transformer.h.1.attn.c_attn.weight', 3072, 3.33713552424278, 0.174859127902447, 0.0342107648313715),
            ('transformer.h.1.attn.c_proj.weight', 1024, 4.70988800094125, -0.0815622514284362, 0.0520813867526866),
            ('transformer.h.1.ln_2.weight', 32, -0.856356749361848, -0.0580635256289259, 0.0338200213962969),
            ('transformer.h.1.mlp.c_fc.weight', 4096, -5.33752320843255, -0.142613669575138, 0.0207036060192327),
            ('transformer.h.1.mlp.c_proj.weight', 4096, -0.819933366821189, 0.464677244051319, 0.0652425785295766),
            ('transformer.ln_f.weight', 32, -0.413186636308098, 0.0407786894161864, 0.111479156669331),
        ],
    },
    'gpt Library bias=True': {
        'logits': [29.662653873876, -435.194699814045, -457.115725115086, 122.532146427082,
                   -88.3174297944415, 194.018732763207, -9.84144197761498, -586.988228875843],
        'loss': 5.28794203136824,
        'params': [
            ('transformer.wte.weight', 1952, 16.8564517721529, 0.556669788229496, 0.415531028772717),
            ('transformer.wpe.weight', 8192, 1.92896495718739, -0.00494342287767533, 0.00881344925767666),
            ('transformer.h.0.ln_1.weight', 32, -1.20222346714525, -0.0223625806731366, 0.0219962459618041),
            ('transformer.h.0.ln_1.bias', 32, -1.56676826339564, 0.0232397635386978, 0.0568471773016373),
            ('transformer.h.0.attn.c_attn.weight', 3072, -6.22182262965791, -0.160362349380162, 0.0507616926768843),
            ('transformer.h.0.attn.c_attn.bias', 96, -0.986075852116744, -0.0693360389831905, 0.0388378230334872),
            ('transformer.h.0.attn.c_proj.weight', 1024, -4.75760603310017, 0.507688480372113, 0.151631036241257),
            ('transformer.h.0.attn.c_proj.bias', 32, -0.202952908577832, 0.0693816540801167, 0.0575190865358255),
            ('transformer.h.0.ln_2.weight', 32, -0.264247655965476, 0.0380978730725636, 0.027700482414158),
            ('transformer.h.0.ln_2.bias', 32, -0.781850809124854, 0.12088529555621, 0.0237640786241307),
            ('transformer.h.0.mlp.c_fc.weight', 4096, 0.35514058573856, -0.125548180016376, 0.0595814256433178),
            ('transformer.h.0.mlp.c_fc.bias', 128, 0.169878200536087, -0.0202304396416456, 0.0197236776949798),
            ('transformer.h.0.mlp.c_proj.weight', 4096, -1.0495996782482, -0.364951577322207, 0.200022344494995),
            ('transformer.h.0.mlp.c_proj.bias', 32, -0.68683087050227, -0.0245910012486456, 0.0545773678174668),
            ('transformer.h.1.ln_1.weight', 32, -1.55118732219149, -0.0954220011385722, 0.0485970978747011),
            ('transformer.h.1.ln_1.bias', 32, -0.311480460502831, -0.0355606476660608, 0.0320406176660481),
            ('transformer.h.1.attn.c_attn.weight', 3072, 4.56111014993874, 0.545806873972571, 0.11556544393908),
            ('transformer.h.1.attn.c_attn.bias', 96, -0.194675230840031, -0.121789116200348, 0.0372272825248973),
            ('transformer.h.1.attn.c_proj.weight', 1024, -8.96643009508515, 0.222332117782671, 0.115555729960082),
            ('transformer.h.1.attn.c_proj.bias', 32, -0.221420932834276, -0.00599010745376757, 0.0428941290452327),
            ('transformer.h.1.ln_2.weight', 32, -0.432378784848426, -0.0289556599474303, 0.0219676929032715),
            ('transformer.h.1.ln_2.bias', 32, -1.24811276059068, 0.0754273420537875, 0.0157971552934115),
            ('transformer.h.1.mlp.c_fc.weight', 4096, 5.85011375341856, 0.105569666855586, 0.0599371759054707),
            ('transformer.h.1.mlp.c_fc.bias', 128, 2.02205206938622, -0.0208841603921245, 0.0229655447801718),
            ('transformer.h.1.mlp.c_proj.weight', 4096, -0.634737753539587, 0.947652561959978, 0.101928626378394),
            ('transformer.h.1.mlp.c_proj.bias', 32, 0.0103256614309546, -0.0412935364307683, 0.0427806586298089),
            ('transformer.ln_f.weight', 32, -1.90442460268175, 0.181744575000562, 0.191760831415755),
            ('transformer.ln_f.bias', 32, -0.976953096899449, -0.179747103518995, 0.152372198724345),
        ],
    },
    'gpt nanoMosaics bias=False': {
        'logits': [-56.260783194848, 5.34064492302985, -294.546024774586, 408.493555114014,
                   472.921519082811, -446.311889063131, 204.740404109001, -115.374482018874],
        'loss': 4.55623822305376,
        'params': [
            ('transformer.wte.weight', 1952, 16.8564517721529, -0.561407542735092, 0.0718550230446992),
            ('transformer.wpe.weight', 8192, -4.05302096780408, 0.410118470630899, 0.0234830778126153),
            ('transformer.h.0.ln_1.weight', 32, -1.20222346714525, -0.0707650958820724, 0.0282152823529242),
            ('transformer.h.0.attn.c_attn.weight', 3072, 6.97591474517292, 0.0671978106065892, 0.0355736852920142),
            ('transformer.h.0.attn.c_proj.weight', 1024, 9.74209717258834, -0.216705327042471, 0.0343647022757091),
            ('transformer.h.0.ln_2.weight', 32, -1.37913445678736, -0.0405528521081781, 0.0235634541059043),
            ('transformer.h.0.mlp.c_fc.weight', 4096, 13.5501364348924, -0.187927291085529, 0.0207181296486344),
            ('transformer.h.0.mlp.c_proj.weight', 4096, 0.141115800949695, 0.413335989806454, 0.0633363751450918),
            ('transformer.h.1.ln_1.weight', 32, -0.996006286223066, -0.0300035882943494, 0.0225899256256816),
            ('transformer.h.1.attn.c_attn.weight', 3072, 3.33713552424278, 0.174935109967252, 0.0342197751175779),
            ('transformer.h.1.attn.c_proj.weight', 1024, 4.70988800094125, -0.0815388537281224, 0.0520883172333197),
            ('transformer.h.1.ln_2.weight', 32, -0.856356749361848, -0.0580687009365356, 0.0338203517374234),
            ('transformer.h.1.mlp.c_fc.weight', 4096, -5.33752320843255, -0.142573074311346, 0.0207045077002334),
            ('transformer.h.1.mlp.c_proj.weight', 4096, -0.819933366821189, 0.464712418002441, 0.0652444156986956),
            ('transformer.ln_f.weight', 32, -0.413186636308098, 0.0407812169968895, 0.11148281921316),
        ],
    },
    'seq_icl transformer': {
        'logits': [-517.30875393808, 86.1572807303276, 180.983440991526, -91.0968557940002,
                   -57.3519414588009, 160.301952419917, -522.330698422619, -30.27603310145],
        'loss': 3.90569716314212,
        'params': [
            ('backbone.embeddings.word_embeddings.weight', 640, -4.72872641164598, -2.14257790040252, 0.632935855068284),
            ('backbone.embeddings.position_embeddings.weight', 30336, 53.8370435584086, 0.0626719654625098, 0.0071057184660469),
            ('backbone.layers.0.mixer.Wqkv.weight', 3072, 11.2663995566872, -0.607843641925411, 0.0827517211306769),
            ('backbone.layers.0.mixer.Wqkv.bias', 96, 0.364395417556671, -0.0203086391669182, 0.050073137282852),
            ('backbone.layers.0.mixer.out_proj.weight', 1024, -2.3768993470314, -0.648768393360607, 0.105696948864645),
            ('backbone.layers.0.mixer.out_proj.bias', 32, 0.142712487845818, 0.168512564673779, 0.0435828898453203),
            ('backbone.layers.0.norm1.weight', 32, -1.52997678684212, -0.0071083530464721, 0.013647960028724),
            ('backbone.layers.0.norm1.bias', 32, -1.33615308267653, -0.0296691601365041, 0.0405010906055799),
            ('backbone.layers.0.mlp.fc1.weight', 4096, -0.918692581653398, -0.860136254927909, 0.0584902776253422),
            ('backbone.layers.0.mlp.fc1.bias', 128, 1.06164309498173, -0.0885266465252016, 0.0209868950605508),
            ('backbone.layers.0.mlp.fc2.weight', 4096, 6.50519230183845, 0.828199159517934, 0.143751298182895),
            ('backbone.layers.0.mlp.fc2.bias', 32, -0.33736116685117, 0.162867782674673, 0.0380035505082605),
            ('backbone.layers.0.norm2.weight', 32, -1.01847825576158, 0.0248548984480414, 0.0254456418626351),
            ('backbone.layers.0.norm2.bias', 32, -1.61164357948586, 0.0107391993220461, 0.023156336057129),
            ('backbone.layers.1.mixer.Wqkv.weight', 3072, 2.9287243618145, 0.826985226697657, 0.129026921180108),
            ('backbone.layers.1.mixer.Wqkv.bias', 96, 1.86952823274084, 0.180766909816816, 0.0447532075720297),
            ('backbone.layers.1.mixer.out_proj.weight', 1024, -3.85133684375917, -1.00660281002508, 0.095929457444162),
            ('backbone.layers.1.mixer.out_proj.bias', 32, -0.892503723414044, 0.191958782836496, 0.0303905806063488),
            ('backbone.layers.1.norm1.weight', 32, -0.659193443137517, -0.131954134857665, 0.0701677463619699),
            ('backbone.layers.1.norm1.bias', 32, -1.01036540042467, -0.0400462437596432, 0.043781371134658),
            ('backbone.layers.1.mlp.fc1.weight', 4096, -19.6291484557239, -0.872689598000979, 0.0416622147958842),
            ('backbone.layers.1.mlp.fc1.bias', 128, -2.07311322153276, 0.078731735948359, 0.0173193000350379),
            ('backbone.layers.1.mlp.fc2.weight', 4096, 3.66560060053832, -0.981478846946524, 0.0762867670059649),
            ('backbone.layers.1.mlp.fc2.bias', 32, 0.14649484115084, 0.174834201039452, 0.0330944307985461),
            ('backbone.layers.1.norm2.weight', 32, -1.32389598143697, -0.0504567132244901, 0.0225682173617973),
            ('backbone.layers.1.norm2.bias', 32, -1.49069812698158, 0.0408516171940778, 0.0291446448516265),
            ('backbone.ln_f.weight', 32, -1.16758123304253, 0.0636651881624714, 0.189673649821918),
            ('backbone.ln_f.bias', 32, -0.773561815983774, 0.501229176801929, 0.140187011938049),
        ],
    },
    'seq_icl lstm': {
        'logits': [-2.83675233370599, -30.2809483010462, -14.3494428797549, -27.6952449638069,
                   -4.8430140417329, 3.21085895234174, -15.9709978207437, -2.69096656582386],
        'loss': 3.00214109591611,
        'params': [
            ('embeddings.word_embeddings.weight', 640, -4.72872641164598, -0.00398455907905842, 0.00356543322630628),
            ('mixer.1.lstm.weight_ih_l0', 4096, -3.73764705337882, 0.00724737203341767, 0.000802877220309575),
            ('mixer.1.lstm.weight_hh_l0', 4096, -12.3981363410372, -0.00940738085687128, 0.00128341726476263),
            ('mixer.1.lstm.bias_ih_l0', 128, 0.60364330378919, 0.023397914321471, 0.00768975913047727),
            ('mixer.1.lstm.bias_hh_l0', 128, 0.855865181363139, 0.023397914321471, 0.00768975913047726),
        ],
    },
    'eft bias=False pre_ln=True attn_only=False': {
        'logits': [58.0960364970807, -57.3712835907475, -31.1418198274219, 58.3263438840242,
                   -38.302111532137, -29.1986755739427, 0.103969831480378, -17.5056482265668],
    },
    'eft bias=True pre_ln=False attn_only=False': {
        'logits': [5.92183394241404, -2.28364382461349, -55.2668955277105, 45.9936125426705,
                   47.7745354879753, 19.6124642330247, -0.208518249636424, -35.000223740648],
    },
    'eft bias=True pre_ln=True attn_only=True': {
        'logits': [-47.4525730502826, -0.861054361470564, -92.2951650257749, 23.3834887875349,
                   -0.768531189134857, 38.3005976640016, 7.7005996991571, 0.290022103717693],
    },
    'regbench mm plug-in': {
        'logits': [-43.9931701761306, -3.22580452180392, -4.47979862252266, 4.23627586665347,
                   -3.07188957888611, 10.1220528691831, 19.0491422875454, 2.23661412933378],
    },
}

# the run's label (test_official_code's) -> {weight's owai name: (size, values . direction, largest |value|)}
TRAINED = {
    'library training loop vs owai mosaic-train': {
        'lm_head.weight': (16384, -33.1317225545532, 0.674985103199034),
        'model.h.0.ctx.c_proj.weight': (1024, 3.40808293224432, 0.571485685914023),
        'model.h.0.ctx.key.leak': (2, -0.193476836421476, 0.487082325319581),
        'model.h.0.ctx.key.proj.weight': (1024, 7.06407454546317, 0.715762157662877),
        'model.h.0.ctx.key.scale': (2, -0.0592464335539436, 0.257428754085391),
        'model.h.0.ctx.value.mix': (2, 0.148774410828072, 1.08482545980081),
        'model.h.0.ctx.value.proj.weight': (1024, -1.73052826169721, 0.635425445144336),
        'model.h.0.ctx.value.scale': (2, 0.0438959752976214, 0.114220106000388),
        'model.h.0.ln_1.weight': (32, -1.80738940640159, 1.21847306601347),
        'model.h.0.ln_2.weight': (32, -1.15320592539413, 1.15770172107661),
        'model.h.0.pmem.c_proj.weight': (1024, -2.11411441110191, 0.635948758312173),
        'model.h.0.pmem.key.leak': (2, 0.0519324789769321, 0.382295861987325),
        'model.h.0.pmem.key.proj.weight': (1024, -8.159430549242, 0.75108596874483),
        'model.h.0.pmem.key.scale': (2, 0.000266417439951046, 0.247482349391062),
        'model.h.0.pmem.mem_k': (768, -0.644130619036672, 0.772546326123859),
        'model.h.0.pmem.mem_v': (768, 3.083713636411, 0.912512289721836),
        'model.h.0.pmem.out_scale': (2, 0.0478591174752609, 0.108666883653226),
        'model.ln_f.weight': (32, -1.2391234378153, 1.15182279127862),
        'model.wte.weight': (16384, -33.1317225545532, 0.674985103199034),
    },
    'nano training loop vs owai mosaic-train': {
        'lm_head.weight': (16384, -33.6058146973484, 0.69707714524356),
        'model.h.0.ctx.c_proj.weight': (1024, 4.22412597330468, 0.566225090887183),
        'model.h.0.ctx.key.leak': (2, 0.0716380234076302, 0.423540482879982),
        'model.h.0.ctx.key.proj.weight': (1024, 12.0215246749489, 0.708035740511111),
        'model.h.0.ctx.key.scale': (2, 0.0640784676236425, 0.264309971456924),
        'model.h.0.ctx.value.mix': (2, -0.0982237661717783, 0.975984396134915),
        'model.h.0.ctx.value.proj.weight': (1024, 8.954160807316, 0.682958222146501),
        'model.h.0.ctx.value.scale': (2, 0.00592513365940215, 0.0175173823880488),
        'model.h.0.ln_1.weight': (32, -1.73329888189783, 1.23132073637153),
        'model.h.0.ln_2.weight': (32, -1.02602017478994, 1.14398385993859),
        'model.h.0.pmem.c_proj.weight': (1024, -0.43421822682119, 0.622696289425745),
        'model.h.0.pmem.key.leak': (2, -0.120318448306363, 0.416242004418228),
        'model.h.0.pmem.key.proj.weight': (1024, -0.245224331511235, 0.756122655487631),
        'model.h.0.pmem.key.scale': (2, -0.0642633651168912, 0.130418858192896),
        'model.h.0.pmem.mem_k': (768, -8.37548040345889, 0.775981751525417),
        'model.h.0.pmem.mem_v': (768, 2.57419964646531, 0.93810753177998),
        'model.h.0.pmem.out_scale': (2, -0.0251971274789318, 0.0757849356246961),
        'model.ln_f.weight': (32, -1.16580175894738, 1.10085088045975),
        'model.wte.weight': (16384, -33.6058146973484, 0.69707714524356),
    },
    'RFC erm_train / owai erm': {
        'featurizer.lin1.bias': (390, -0.0980090708590594, 0.0138684195107988),
        'featurizer.lin1.weight': (152880, -10.9870357376605, 0.0981256567052505),
        'featurizer.lin2.bias': (390, 0.056035168058276, 0.0141317714195813),
        'featurizer.lin2.weight': (152100, 16.2888496408938, 0.0978884388155822),
        'head.bias': (1, 0.000650893784544928, 0.00098418635717081),
        'head.weight': (390, 2.02039748205869, 0.129497205833039),
    },
    'RFC irm_train / owai irm': {
        'featurizer.lin1.bias': (390, -0.0934547016756274, 0.0109672289209277),
        'featurizer.lin1.weight': (152880, -13.4221575659423, 0.0979112664102809),
        'featurizer.lin2.bias': (390, 0.0590088762178411, 0.0115270991662333),
        'featurizer.lin2.weight': (152100, 17.4895938571414, 0.0999934263044514),
        'head.bias': (1, -0.00380395984524989, 0.00575179157001477),
        'head.weight': (390, 2.01480361716913, 0.12759395471876),
    },
    'RFC vrex_train / owai vrex': {
        'featurizer.lin1.bias': (390, -0.11259863653568, 0.0113810916541388),
        'featurizer.lin1.weight': (152880, -13.2232501151005, 0.0996514030994243),
        'featurizer.lin2.bias': (390, 0.0641846036175279, 0.0121516847732701),
        'featurizer.lin2.weight': (152100, 18.0971202409383, 0.100178547411854),
        'head.bias': (1, -0.00485842113749141, 0.00734619367160248),
        'head.weight': (390, 1.99587314976444, 0.128715909561849),
    },
    'RFC iga_train / owai iga': {
        'featurizer.lin1.bias': (390, -0.19151076914136, 0.01213165135919),
        'featurizer.lin1.weight': (152880, -13.1854667031659, 0.099123851303726),
        'featurizer.lin2.bias': (390, 0.0961041974371731, 0.0130930225785243),
        'featurizer.lin2.weight': (152100, 16.6155796028397, 0.100981036436909),
        'head.bias': (1, 0.00481793534124584, 0.00728497697347107),
        'head.weight': (390, 1.94378475813617, 0.12524962753631),
    },
    'RFC sd_train / owai sd': {
        'featurizer.lin1.bias': (390, -0.0129730465332513, 0.00880706211417994),
        'featurizer.lin1.weight': (152880, -12.7197800147577, 0.0956425695276742),
        'featurizer.lin2.bias': (390, 0.0431575269752759, 0.009196536588195),
        'featurizer.lin2.weight': (152100, 17.6885681301073, 0.0949059051200597),
        'head.bias': (1, 0.000658866011516641, 0.000996240792484422),
        'head.weight': (390, 2.0327250562719, 0.121698655039321),
    },
    'RFC gm_train / owai fish': {
        'featurizer.lin1.bias': (390, -0.119408087671409, 0.0143759836820607),
        'featurizer.lin1.weight': (152880, -11.3913462468265, 0.100159768731559),
        'featurizer.lin2.bias': (390, 0.0544021923675544, 0.0136849516431257),
        'featurizer.lin2.weight': (152100, 15.6723936028992, 0.0993286345672142),
        'head.bias': (1, 6.60434835552529e-05, 9.98612938677218e-05),
        'head.weight': (390, 2.06388672600594, 0.129558289598148),
    },
    'RFC dro_train / owai rerm': {
        'featurizer.lin1.bias': (390, -0.111926358112901, 0.0152892611321701),
        'featurizer.lin1.weight': (152880, -10.480535731771, 0.099886947064175),
        'featurizer.lin2.bias': (390, 0.0360831777671029, 0.0156010976718656),
        'featurizer.lin2.weight': (152100, 16.9878403633751, 0.0993467593827382),
        'head.bias': (1, 0.00197363836388469, 0.00298424719646429),
        'head.weight': (390, 1.97202631100213, 0.133141440428377),
    },
    'RFC fishr_train / owai fishr': {
        'featurizer.lin1.bias': (390, -0.154639175357551, 0.0117369374111854),
        'featurizer.lin1.weight': (152880, -13.5788465881596, 0.0962135611661916),
        'featurizer.lin2.bias': (390, 0.101886586918682, 0.0141052379734738),
        'featurizer.lin2.weight': (152100, 18.5737798003005, 0.0972829967279671),
        'head.bias': (1, -0.00383726394014342, 0.00580214915002309),
        'head.weight': (390, 2.07012789276261, 0.131212415967295),
    },
    'RFC clove_train / owai clove': {
        'featurizer.lin1.bias': (390, -0.150833809213572, 0.00853493520621946),
        'featurizer.lin1.weight': (152880, -14.8244736331672, 0.0985386070463421),
        'featurizer.lin2.bias': (390, 0.0503991335028094, 0.00872783002236423),
        'featurizer.lin2.weight': (152100, 19.9555138507939, 0.0997855371515447),
        'head.bias': (1, -0.00300904431766073, 0.00454983660296363),
        'head.weight': (390, 2.08085120508964, 0.129982504574587),
    },
    'RFC rsc_train / owai rsc': {
        'featurizer.lin1.bias': (390, -0.0968094763826987, 0.0136238764581533),
        'featurizer.lin1.weight': (152880, -17.8343840836888, 0.100517256533861),
        'featurizer.lin2.bias': (390, 0.00207538157386455, 0.0140643948573803),
        'featurizer.lin2.weight': (152100, 17.7928171556181, 0.102160941691865),
        'head.bias': (2, 0.00600417747999763, 0.00974924375613959),
        'head.weight': (780, -1.09491385420012, 0.136911170260597),
    },
    'RFC lff_train / owai lff': {
        'featurizer.lin1.bias': (390, -0.0778778324883129, 0.00507288434191659),
        'featurizer.lin1.weight': (152880, -14.8018518133414, 0.0921210042554674),
        'featurizer.lin2.bias': (390, -0.00827053455588433, 0.00509007140062323),
        'featurizer.lin2.weight': (152100, 18.8186647288708, 0.0923702736344123),
        'head.bias': (2, 0.000639184273291221, 0.00103787126649187),
        'head.weight': (780, -1.05061683510688, 0.127311788128941),
    },
    'RFC PI.py / owai pi, pi.env1': {
        'featurizer.lin1.bias': (390, 0.0138274946934261, 0.00506197004308423),
        'featurizer.lin1.weight': (152880, 13.1988950749562, 0.0924974508003941),
        'featurizer.lin2.bias': (390, 0.00678125632226309, 0.00504766848653255),
        'featurizer.lin2.weight': (152100, -18.0297944731711, 0.0926090290801824),
        'head.bias': (1, 0.00294653823123243, 0.00445532404352066),
        'head.weight': (390, -1.93492018280772, 0.128115140258771),
    },
    'RFC PI.py / owai pi, pi.env2': {
        'featurizer.lin1.bias': (390, -0.114493417825165, 0.0049695130799251),
        'featurizer.lin1.weight': (152880, -26.7508279318939, 0.0924642634727695),
        'featurizer.lin2.bias': (390, 0.0958717045473573, 0.00503750081357555),
        'featurizer.lin2.weight': (152100, -7.05892798954112, 0.0924661576587608),
        'head.bias': (1, -0.00225740268621291, 0.00341331409081558),
        'head.weight': (390, -3.7990924348267, 0.126532472245251),
    },
    'RFC PI.py / owai pi, train': {
        'featurizer.lin1.bias': (390, -0.058996259287951, 0.01336546449416),
        'featurizer.lin1.weight': (152880, -9.81081574935498, 0.0982062534061378),
        'featurizer.lin2.bias': (390, -0.00711878093193746, 0.0133010029781835),
        'featurizer.lin2.weight': (152100, 17.7203382814302, 0.0980502294660785),
        'head.bias': (1, 0.000375372911033876, 0.000567584000128876),
        'head.weight': (390, 2.0743029393345, 0.129688960524219),
    },
    'RFC Bonsai / owai bonsai, bonsai.round0': {
        'featurizer.lin1.bias': (390, -0.104332735455876, 0.0049840211377054),
        'featurizer.lin1.weight': (152880, -15.0154278485519, 0.0923420656799758),
        'featurizer.lin2.bias': (390, 0.0434993465268356, 0.00504154794340806),
        'featurizer.lin2.weight': (152100, 19.7675547874593, 0.0924118824666405),
        'head.bias': (1, -0.00227074044927201, 0.00343348150483862),
        'head.weight': (390, 2.07231469139851, 0.128281914393794),
    },
    'RFC Bonsai / owai bonsai, bonsai.round1': {
        'featurizer.lin1.bias': (390, -0.0170050191466471, 0.00483240158852259),
        'featurizer.lin1.weight': (152880, -13.5039479986756, 0.0920290919625344),
        'featurizer.lin2.bias': (390, -0.00505965841084592, 0.00502641263448385),
        'featurizer.lin2.weight': (152100, 18.7691107357422, 0.0917889689416692),
        'head.bias': (1, -0.00125057889154246, 0.00189094244383114),
        'head.weight': (390, 2.06334567334789, 0.125222963413853),
    },
    'RFC Bonsai / owai bonsai, bonsai.synthesis': {
        'featurizer.lin1.bias': (390, -0.187443110468592, 0.00506101103461768),
        'featurizer.lin1.weight': (152880, -12.8589362128569, 0.0926372216447844),
        'featurizer.lin2.bias': (390, -0.0370797132699851, 0.00507677842738847),
        'featurizer.lin2.weight': (152100, 19.2343375402605, 0.0927120429682761),
        'head.bias': (2, 0.00251569795727603, 0.0043544047863055),
        'head.weight': (780, -1.1472547954069, 0.12814898023086),
    },
    'RFC Bonsai / owai bonsai, train': {
        'featurizer.lin1.bias': (390, -0.0261745167491321, 0.0136283367192639),
        'featurizer.lin1.weight': (152880, -11.6396202394986, 0.0973709494969614),
        'featurizer.lin2.bias': (390, 0.0203147281459663, 0.0120073861700696),
        'featurizer.lin2.weight': (152100, 17.54552069129, 0.0991363346870248),
        'head.bias': (1, -0.000785116897035687, 0.00118713891143858),
        'head.weight': (390, -0.774381352164482, 0.114552926201747),
    },
    'RFC Bonsai / owai bonsai-cf, bonsai.round0': {
        'featurizer.lin1.bias': (390, -0.104332735455876, 0.0049840211377054),
        'featurizer.lin1.weight': (152880, -15.0154278485519, 0.0923420656799758),
        'featurizer.lin2.bias': (390, 0.0434993465268356, 0.00504154794340806),
        'featurizer.lin2.weight': (152100, 19.7675547874593, 0.0924118824666405),
        'head.bias': (1, -0.00227074044927201, 0.00343348150483862),
        'head.weight': (390, 2.07231469139851, 0.128281914393794),
    },
    'RFC Bonsai / owai bonsai-cf, bonsai.round1': {
        'featurizer.lin1.bias': (390, -0.0170050191466471, 0.00483240158852259),
        'featurizer.lin1.weight': (152880, -13.5039479986756, 0.0920290919625344),
        'featurizer.lin2.bias': (390, -0.00505965841084592, 0.00502641263448385),
        'featurizer.lin2.weight': (152100, 18.7691107357422, 0.0917889689416692),
        'head.bias': (1, -0.00125057889154246, 0.00189094244383114),
        'head.weight': (390, 2.06334567334789, 0.125222963413853),
    },
    'RFC Bonsai / owai bonsai-cf, bonsai.synthesis': {
        'featurizer.lin1.bias': (390, -0.187443110468592, 0.00506101103461768),
        'featurizer.lin1.weight': (152880, -12.8589362128569, 0.0926372216447844),
        'featurizer.lin2.bias': (390, -0.0370797132699851, 0.00507677842738847),
        'featurizer.lin2.weight': (152100, 19.2343375402605, 0.0927120429682761),
        'head.bias': (2, 0.00251569795727603, 0.0043544047863055),
        'head.weight': (780, -1.1472547954069, 0.12814898023086),
    },
    'RFC Bonsai / owai bonsai-cf, train': {
        'featurizer.lin1.bias': (390, -0.187443110468592, 0.00506101103461768),
        'featurizer.lin1.weight': (152880, -12.8589362128569, 0.0926372216447844),
        'featurizer.lin2.bias': (390, -0.0370797132699851, 0.00507677842738847),
        'featurizer.lin2.weight': (152100, 19.2343375402605, 0.0927120429682761),
        'head.bias': (1, -0.00994965530665866, 0.0150444131498535),
        'head.weight': (390, -0.685610936465033, 0.11931658388303),
    },
    'Three Moons training heads=1': {
        'key.r': (9, -0.14252718234488, 0.714507976804291),
        'key.s': (9, -1.06259474920814, 0.550923412658435),
        'out.r': (9, 0.288052247494688, 0.549773175616768),
        'out.s': (9, 1.17919374177558, 0.71883783193634),
        'value.r': (9, 1.31099498605697, 0.615476236037966),
        'value.s': (9, 0.62223335408088, 0.629252816520618),
    },
    'Three Moons training heads=3': {
        'key.r': (9, -0.39984816872667, 0.644513791787525),
        'key.s': (9, 0.714790772223317, 0.438481303842218),
        'out.r': (9, 1.46696978724296, 0.541228252723863),
        'out.s': (9, 0.0881780679638478, 0.489012232948721),
        'value.r': (9, 1.3757024737029, 0.471205766593927),
        'value.s': (9, 0.223047349098738, 0.492497976859355),
    },
}

# heads -> the Three Moons code's error curves on owai's trained weights (its `generate` and
# `generate_nocache`, as the parity test computes them): the contexts tau, then per panel
# (reference: the cached generation's error, exact: the uncached one's) one value per tau
MOON_CURVES = {
    1: {
        'tau': [1, 98, 195, 292, 389, 486, 583, 680],
        ('train', 'reference'): [0.63558615206896, 0.614845521865656, 0.720418415270408, 0.737254403051039,
                                 0.630884422578278, 0.315147710433576, 0.336110477596253, 0.366534222653629],
        ('train', 'exact'): [0.63558615206896, 2.19877151523711, 1.8902029984537, 2.15713459803068,
                             2.47392666832772, 1.83920532330724, 1.26887233808505, 1.84255003735091],
        ('val', 'reference'): [0.638540984963377, 0.590450537262613, 0.685773488864273, 0.479756284309706,
                               0.211124962255099, 0.481585703595081, 0.510809519406584, 0.438304184722861],
        ('val', 'exact'): [0.638540984963377, 1.69012470566127, 1.93796691518281, 1.11262115185943,
                           1.04387609825192, 0.520028894211182, 1.99864046437676, 0.449268397109331],
    },
    3: {
        'tau': [1, 98, 195, 292, 389, 486, 583, 680],
        ('train', 'reference'): [0.63558615206896, 0.782839385409124, 0.708814093932587, 0.535081953819927,
                                 0.613985637632774, 0.683287540552676, 0.560744234284572, 0.609785550764632],
        ('train', 'exact'): [0.63558615206896, 0.750587739785648, 0.746371646533861, 0.490094036815963,
                             0.577736935516195, 0.686153296028537, 0.538359537870853, 0.592191009964525],
        ('val', 'reference'): [0.638540984963377, 0.58398478758821, 0.738178211570583, 0.703432351318636,
                               0.754753284605499, 0.548826981962393, 0.886063044089291, 0.705290955886708],
        ('val', 'exact'): [0.638540984963377, 0.738816314839029, 0.618697125574762, 0.679522023641352,
                           0.709468357718221, 0.550338928367163, 0.867951088415987, 0.715117606431839],
    },
}

# the test's case -> per step: (the loss, its gradient on the logits . direction, largest |gradient|);
# GroupDRO's also the weights q of the groups in training
CAMELYON = {
    'erm-0.5': [
        (0.954772663252309, -0.106581732560996, 0.0293869454129726),
        (0.954772663252309, -0.106581732560996, 0.0293869454129726),
    ],
    'erm-100.0': [
        (0.954772663252309, -0.106581732560996, 0.0293869454129726),
        (0.954772663252309, -0.106581732560996, 0.0293869454129726),
    ],
    'irm-0.5': [
        (0.954772663252309, -0.106581732560996, 0.0293869454129726),
        (1.03810259137166, -0.133651723795106, 0.0469641765231294),
    ],
    'irm-100.0': [
        (0.954772663252309, -0.106581732560996, 0.0293869454129726),
        (0.176207582871225, -0.0552057997938302, 0.0362919524889897),
    ],
    'vrex-0.5': [
        (0.954772663252309, -0.106581732560996, 0.0293869454129726),
        (0.959532771716457, -0.114872340875192, 0.0317889830750374),
    ],
    'vrex-100.0': [
        (0.954772663252309, -0.106581732560996, 0.0293869454129726),
        (0.0190679435608184, -0.0176470339540019, 0.00594156559280566),
    ],
    'groupdro': [
        (1.83018287521013, -0.100589287209746, 0.0416563160036037, (0.334115821430915, 0.333117760238588, 0.332766418330498)),
        (1.49885778292521, 0.121497967757238, 0.0211066204251044, (0.334344050419217, 0.337817171665704, 0.327838777915078)),
        (1.33874356450459, 0.149563006628752, 0.033863917786047, (0.334642283742785, 0.339766273100318, 0.325591443156897)),
        (1.61350598372643, -0.145851093935594, 0.0265840956956199, (0.333993271612177, 0.345597144046775, 0.320409584341048)),
        (2.25765843105336, 0.195350780369501, 0.0337270953355237, (0.337291043794556, 0.344303181193174, 0.318405775012269)),
    ],
}


def _probes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().double().flatten()
    return flat @ torch.randn(flat.numel(), N_PROBES, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _direction(n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)


def _library(bias: bool, pre_ln: bool, attn_only: bool, sharp: bool):
    sd = random_official_state_dict("library", V=V, C=C, H=H, L=LAYERS, P=P, bias=bias, attn_only=attn_only, sharp=sharp)
    return _owai_model(sd, "library", norm_eps=0.0, pre_ln=pre_ln), IDS, TARGETS, 1e-6 if sharp else None


def _nano(bias: bool, sharp: bool):
    sd = random_official_state_dict("nano", V=V, C=C, H=H, L=LAYERS, P=P, bias=bias, sharp=sharp)
    return _owai_model(sd, "nano"), IDS, TARGETS, 1e-8 if sharp else None


def _eft(bias: bool, pre_ln: bool, attn_only: bool):
    """The Library's eft model through the converter's eft path: logits only (test_official_code's
    parity test replaces its CUDA kernel by the formula, whose backward is not the kernel's)."""
    sd = random_official_state_dict("library", variant="eft", V=V, C=C, H=H, L=LAYERS, P=P, bias=bias,
                                    attn_only=attn_only, sharp=False)
    return _owai_model(sd, "library", norm_eps=0.0, pre_ln=pre_ln), IDS, TARGETS, 1e-10


def _regbench_mm():
    """`owai eval regbench`'s default `mm` holding one random Library state dict, sized as ICLL's
    mm.yaml (n_embd 128, 8 heads, 2 layers, pmem 448): the plug-in's logits at the data's longest
    input, to its test's 1e-7 (owai's unit norms add 1e-10 where the Library's add nothing)."""
    cfg = RegBenchConfig()
    sd = random_official_state_dict("library", V=cfg.data.vocab_size, C=128, H=8, L=2, P=448, bias=False, sharp=False)
    model = build_regbench_model(cfg, torch.device("cpu"))
    model.load_state_dict(convert_official_state_dict(sd, "library", leaky_chunk=16)[1], strict=True)
    ids = torch.randint(0, cfg.data.vocab_size, (2, regbench_max_input_length(cfg.data)),
                        generator=torch.Generator().manual_seed(0))
    return model.double().eval(), ids, None, 1e-7


def _gpt(source: str, bias: bool):
    chosen = {} if source == "Library" else {"activation": "gelu"}  # the Library's baseline is owai's default
    model = GPTForCausalLM(GPTConfig(vocab_size=V, n_layer=LAYERS, n_embd=C, n_head=H, block_size=T, dropout=0.0,
                                     bias=bias, **chosen))
    return _randomised(model).eval(), IDS, TARGETS, None


def _regbench(arch: str):
    """The model `owai eval regbench` builds, sized as seq_icl's dfa yaml (transformer: 2 heads, owai's
    2 layers of width 32; lstm: d_model 32), on 2 random sequences of the data's longest input."""
    cfg = RegBenchConfig(arch=arch)
    if arch == "transformer":
        cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd = 2, 2, 32
    else:
        cfg.model.n_embd = 32
    model = _randomised(build_regbench_model(cfg, torch.device("cpu"))).eval()
    T_R, V_R = regbench_max_input_length(cfg.data), model.config.vocab_size
    ids = torch.randint(0, V_R, (2, T_R), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, V_R, (2, T_R), generator=torch.Generator().manual_seed(1))
    return model, ids, targets, None


CASES = {
    **{f"library bias={a[0]} pre_ln={a[1]} attn_only={a[2]} sharp={a[3]}": (lambda a=a: _library(*a))
       for a in [(False, True, False, False), (True, True, False, False), (False, False, False, False),
                 (True, False, True, False), (False, True, False, True)]},
    **{f"nano bias={a[0]} sharp={a[1]}": (lambda a=a: _nano(*a)) for a in [(False, False), (True, False), (False, True)]},
    **{f"gpt {a[0]} bias={a[1]}": (lambda a=a: _gpt(*a)) for a in [("Library", False), ("Library", True), ("nanoMosaics", False)]},
    "seq_icl transformer": lambda: _regbench("transformer"),
    "seq_icl lstm": lambda: _regbench("lstm"),
    **{f"eft bias={a[0]} pre_ln={a[1]} attn_only={a[2]}": (lambda a=a: _eft(*a))
       for a in [(False, True, False), (True, False, False), (True, True, True)]},
    "regbench mm plug-in": _regbench_mm,
}


def test_every_recorded_case_is_built():
    assert sorted(CASES) == sorted(GOLDEN)


@pytest.mark.parametrize("case", list(CASES))
def test_owai_model_gives_the_official_logits_and_gradients(case):
    """owai's model on the parity test's weights and inputs: the official model's logits (8 random
    projections of all of them) and, where the parity test compares them (not for a sharp head past
    the clamp, eft or the RegBench plug-in), its loss and every parameter's gradient (a random
    projection each, owai's parameter found by its values)."""
    model, ids, targets, logits_only = CASES[case]()  # logits_only: that test's bound on logits alone
    want = GOLDEN[case]
    logits = model(ids).logits
    bound = (logits_only or 1e-10) * 6 * math.sqrt(logits.numel())
    gap = (_probes(logits) - torch.tensor(want["logits"], dtype=torch.float64)).abs().max().item()
    assert gap <= bound, f"{case}: logits' projections differ by {gap:.3e} (bound {bound:.1e})"
    if logits_only is not None:
        return
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert abs(loss.item() - want["loss"]) <= 1e-9, (loss.item(), want["loss"])
    loss.backward()
    for name, p in model.named_parameters():
        r = _direction(p.numel())
        value = float(p.detach().double().flatten() @ r)
        twins = [w for w in want["params"] if w[1] == p.numel() and abs(w[2] - value) <= 1e-9 * max(1.0, abs(value))]
        assert twins, f"{case}: {name}: no official parameter holds its values"
        ref_name, _, _, ref_proj, ref_scale = twins[0]
        got = float(p.grad.double().flatten() @ r)
        scale = float(p.grad.abs().max())
        assert scale > 0, name
        assert abs(scale - ref_scale) <= 1e-9 * ref_scale, f"{case}: {name} ({ref_name}): gradient scale {scale} vs {ref_scale}"
        tol = 1e-9 * ref_scale * 6 * math.sqrt(p.numel())
        assert abs(got - ref_proj) <= tol, f"{case}: {name} ({ref_name}): gradient differs ({got} vs {ref_proj}, bound {tol:.1e})"


# ------------------------------------------------------------------ whole training runs


def _same_trained_weights(label: str, trained: dict[str, torch.Tensor], bound: float = 1e-9) -> None:
    """owai's trained weights against the reference run's recorded ones: each tensor's projection on
    its direction within test_official_code's element-wise `bound` (times 6 sqrt(size)), and its
    largest magnitude."""
    for name, (size, projection, largest) in TRAINED[label].items():
        w = trained[name].detach().double()
        assert w.numel() == size, (label, name)
        got = float(w.flatten() @ _direction(size))
        tol = bound * 6 * math.sqrt(size)
        assert abs(got - projection) <= tol, f"{label}: {name} differs from the reference ({got} vs {projection}, bound {tol:.1e})"
        assert abs(float(w.abs().max()) - largest) <= bound, (label, name)


def _stage(run, stage: str) -> dict[str, torch.Tensor]:
    _, state = load_checkpoint(latest_checkpoint(run.path / "checkpoints" / stage))
    return state["model"]


@pytest.mark.parametrize("method", list(TRAINERS))
def test_owai_bonsai_trains_to_rfcs_weights(method, tmp_path, monkeypatch, float64):
    """`owai bonsai --method M` (table2.4's tiny preset on 1,000 images, ERM init, 10 annealed steps then
    20 with the penalty) ends at the weights RFC's trainer reaches from the same start on the same environments."""
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    run, _ = execute(RECIPE, "tiny", trainer_settings(method), out=tmp_path / "runs")
    trained = _stage(run, "train")
    if method == "lff":  # the run trains a biased copy beside the model: keep the model ("debiased")
        trained = {k.removeprefix("debiased."): v for k, v in trained.items() if k.startswith("debiased.")}
    _same_trained_weights(f"RFC {TRAINERS[method][0]} / owai {method}", trained)


def test_owai_pi_trains_to_rfcs_weights(tmp_path, monkeypatch, float64):
    """`owai bonsai --method pi` (table2.5-pi, tiny): both stage-1 models and the final RERM model at
    the weights of RFC's PI.py from the same starts and hold-outs."""
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    run, _ = execute("table2.5-pi", "tiny", PI_SETTINGS, out=tmp_path / "runs")
    for stage in ("pi.env1", "pi.env2", "train"):
        _same_trained_weights(f"RFC PI.py / owai pi, {stage}", _stage(run, stage))


@pytest.mark.parametrize("init", ["bonsai", "bonsai-cf"])
def test_owai_bonsai_init_trains_to_rfcs_weights(init, tmp_path, monkeypatch, float64):
    """`owai bonsai --init bonsai[-cf] --method vrex` (tiny, 10 steps a Bonsai phase, 30 vREx steps):
    each phase and the downstream model at the weights of RFC's Bonsai scripts and vrex_train."""
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    run, _ = execute(RECIPE, "tiny", bonsai_settings(init), out=tmp_path / "runs")
    for stage in ("bonsai.round0", "bonsai.round1", "bonsai.synthesis", "train"):
        _same_trained_weights(f"RFC Bonsai / owai {init}, {stage}", _stage(run, stage))


@pytest.mark.parametrize("source", ["library", "nano"])
def test_owai_mosaic_train_trains_to_the_reference_loops_weights(source, tmp_path, monkeypatch, default_float64):
    """`owai mosaic-train`'s whole run of a one-layer Memory Mosaic from one random official state dict,
    in float64: the weights the Library's / nanoMosaics' training loop reaches on the same batches."""
    import owai.models.lm as owai_models

    monkeypatch.setattr(owai_models, "build_lm", official_lm_builder(source, owai_models.build_lm, {}, []))
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    run, _ = execute("fig3.8-depth", "cpu", lm_settings(source), out=tmp_path / "runs")
    _same_trained_weights(f"{source} training loop vs owai mosaic-train", _stage(run, "mm"), bound=1e-10)


@pytest.mark.parametrize("heads", [1, 3])
def test_owai_moons_trains_to_the_three_moons_codes_weights(heads, tmp_path, monkeypatch, default_float64):
    """`owai moons`'s whole run (cpu preset, 30 steps of batch 4, its batches in float64) at the
    weights the Three Moons code's MLX loop reaches from the same start (MLX's float64 as far as
    it goes: test_official_code's bound, 1e-5), and its two error curves at the values the code's
    `generate` / `generate_nocache` give on those weights."""
    sample = owai_moons.sample_sequences
    monkeypatch.setattr(owai_moons, "sample_sequences", lambda *a, **k: sample(*a, **k).double())
    run, results = execute("three-moons", "cpu", moon_settings(heads), out=tmp_path / "runs")
    _same_trained_weights(f"Three Moons training heads={heads}", _stage(run, f"heads{heads}-r0"), bound=1e-5)
    curves, want = results["details"]["variants"][f"heads{heads}"]["curves"], MOON_CURVES[heads]
    for panel in ("train", "val"):  # the parity test's bound, 1e-5 (MLX's float64 exp)
        for kind in ("reference", "exact"):
            got = dict(zip(curves["tau"], curves[panel][kind]))
            for tau, value in zip(want["tau"], want[(panel, kind)]):
                assert abs(got[tau] - value) <= 1e-5, (heads, panel, kind, tau, got[tau], value)


# ------------------------------------------------------------------ Camelyon17's objectives


def _same_step(label: str, loss: torch.Tensor, grad: torch.Tensor, want: tuple) -> None:
    """A step's loss (test_official_code's rel 1e-12) and its gradient on the logits (rtol 1e-10, atol
    1e-14 element-wise, carried through the projection) against RFC's recorded ones."""
    ref_loss, ref_proj, ref_scale = want[:3]
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-15), label
    tol = (1e-10 * ref_scale + 1e-14) * 6 * math.sqrt(grad.numel())
    assert abs(float(grad.double().flatten() @ _direction(grad.numel())) - ref_proj) <= tol, label
    assert abs(float(grad.abs().max()) - ref_scale) <= 1e-10 * ref_scale + 1e-14, label


@pytest.mark.parametrize("weight", [0.5, 100.0])
@pytest.mark.parametrize("method", ["erm", "irm", "vrex"])
def test_owai_camelyon17_objectives_give_rfcs_losses_and_gradients(method, weight):
    """owai's Camelyon17 downstream objective (`make_downstream_penalty`) on the parity test's batch
    (2 hospitals x 16 patches, 2 logits, split by hospital), before the anneal step and after it:
    the loss and gradient of RFC's ERM / IRM / VREX `objective` (src/algorithms, WILDS's loss)."""
    from owai.methods.camelyon17 import Config as CamelyonConfig
    from owai.methods.camelyon17 import PenaltyConfig, make_downstream_penalty
    from owai.methods.invariance import EnvBatch

    penalty = make_downstream_penalty(CamelyonConfig(method=method, penalty=PenaltyConfig(weight=weight,
                                                                                          anneal_iters=CAMELYON_ANNEAL)))
    logits, y, g = camelyon_batch()
    for step, want in zip((0, CAMELYON_ANNEAL), CAMELYON[f"{method}-{weight}"]):
        ours_in = logits.clone().requires_grad_()
        envs = [EnvBatch(ours_in[g == h], y[g == h]) for h in g.unique_consecutive().tolist()]
        loss = penalty.objective(envs, step).loss
        loss.backward()
        _same_step(f"{method} weight {weight} step {step}", loss, ours_in.grad, want)


def test_owai_group_dro_rounds_give_rfcs_losses_gradients_and_weights():
    """A discovery round's GroupDRO (`group_dro_loss`) over the parity test's 5 steps of random batches
    (4 groups, one never in training; odd steps miss group 2): RFC's groupDRO.py loss and gradient at
    every step, and its group weights of the groups in training."""
    from owai.methods.camelyon17 import group_dro_loss
    from owai.methods.invariance import make_penalty

    eta, in_train = 0.01, torch.tensor([True, True, True, False])
    penalty = make_penalty("groupdro", eta=eta)
    for step, ((logits, y, g), want) in enumerate(zip(group_dro_batches(), CAMELYON["groupdro"], strict=True)):
        ours_in = logits.clone().requires_grad_()
        loss = group_dro_loss(penalty, ours_in, y, g, torch.nonzero(in_train).reshape(-1))
        loss.backward()
        _same_step(f"GroupDRO step {step}", loss, ours_in.grad, want)
        torch.testing.assert_close(penalty.q, torch.tensor(want[3], dtype=penalty.q.dtype), rtol=1e-12, atol=0)


# ------------------------------------------------------------------ RegBench's scores

# sharp -> seq_icl's dfa_accuracy, model_dfa_diff and the in-context 3-gram's L1 to the automaton
# (`_get_dfa_accuracy`, `_writes_to_file`), on test_official_code's batch and logits
REGBENCH_SCORES = {
    False: (0.0953805250913925, 1.80041380336579, 0.519247722735297),
    True: (0.932203389830508, 0.929979781580563, 0.519247722735297),
}


@pytest.mark.parametrize("sharp", [False, True])
def test_owai_regbench_metrics_give_seq_icls_scores(sharp):
    """owai's RegBench metrics on one batch of 8 test automata (make_regbench(20, 16, seed 8)) with
    random logits (`sharp`: +3 on the legal symbols): seq_icl's accuracy (abs 1e-12), total variation
    ("tvd", rel 1e-9) and its 3-gram's L1 (rel 1e-9), as test_official_code's parity test bounds them.
    The 3-gram's accuracy is left out: seq_icl breaks its ties in hash-seed order."""
    from owai.evals.regbench import ngram_backoff_probs, regbench_metrics

    data, inputs, _, pfas, logits = regbench_scoring_batch(sharp)
    accuracy, tvd, ngram_tvd = REGBENCH_SCORES[sharp]
    mine = regbench_metrics(logits, inputs, pfas, from_logits=True)
    ngram = regbench_metrics(ngram_backoff_probs(inputs, data.config.vocab_size, data.config.sep_id), inputs, pfas)
    assert mine["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert mine["tvd"] == pytest.approx(tvd, rel=1e-9)
    assert ngram["tvd"] == pytest.approx(ngram_tvd, rel=1e-9)
