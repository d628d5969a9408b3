"""A deliberately naive Memory Mosaics v1 forward pass, written straight from the spec (tests only).

It reads OFFICIAL state dicts (Library regular/eft keys or nanoMosaics keys) directly, so it shares
nothing with owai's model or converter. Everything is float64, per head, with dense T x T matrices:

    k~ = W_phi x;  kbar_t = sum_{j<=t} A[t, j] k~_j            A = the source's leaky-average matrix
    k = kbar/|kbar| * exp(bandwidth);  v = normalise(c W_psi x_t + (1-c) W_psi x_{t+1}) * exp(10 u)
    y_t = sum_{j<t} softmax_j(k_t . k_j) v_j  (explicit -inf mask),  y_0 = 0
    pmem: y = softmax(k M_k^T) M_v * exp(10 u), k scaled twice

Also builds random official-format state dicts for tiny configs.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


# ------------------------------------------------------------------ random official state dicts


def _rand_scalars(H: int, lo: float, hi: float, g: torch.Generator) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(H, generator=g, dtype=torch.float32)


def random_official_state_dict(source: str, *, V: int = 61, C: int = 32, H: int = 4, L: int = 2, P: int = 24,
                               count: int = 1, bias: bool = False, tied: bool = True, variant: str = "regular",
                               attn_only: bool = False, sharp: bool = True, bandwidth_max: float = 0.3,
                               seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the official key names. source 'library' (variant 'regular' or 'eft') or 'nano'.
    Per-head scalars are random too: leaky rates of both signs (abs is used), bandwidth exponents 10 s in
    [-1, 10 bandwidth_max]; with sharp=True head 0 has 10 s = 6, beyond the Library clamp (5) and, squared, the nano one
    (11.09): scores up to e^10 x cosine, so only float64 can compare such a model to ~1e-9."""
    g = torch.Generator().manual_seed(seed)
    hs = C // H

    def mat(*shape, std=None):
        std = std if std is not None else 1 / math.sqrt(shape[1])
        return torch.randn(*shape, generator=g) * std

    def vec(n, std=0.1):
        return torch.randn(n, generator=g) * std

    leak = lambda: _rand_scalars(H, -0.5, 0.5, g)  # noqa: E731  beta = 10|p| in [0, 5]
    def bandwidth():
        s = _rand_scalars(H, -0.1, bandwidth_max, g)
        if sharp:
            s[0] = 0.6  # clamped
        return s

    scale = lambda: _rand_scalars(H, -0.1, 0.05, g)  # noqa: E731
    sd: dict[str, torch.Tensor] = {}
    emb = mat(V, C, std=1 / math.sqrt(C))
    if source == "library":
        nh = lambda t: t.reshape(H)  # noqa: E731  Library per-head scalars are (H,)
        sd["emb.weight"] = emb
        sd["head.weight"] = emb if tied else mat(V, C)
        for i in range(L):
            b = f"blocks.{i}."
            sd[b + "ln1.weight"] = 1 + vec(C)
            if bias:
                sd[b + "ln1.bias"] = vec(C)
            for unit in ("attn",) + (() if attn_only else ("pmem",)):
                if variant == "eft":
                    sd[f"{b}{unit}.leaky_average.linear.weight"] = mat(C, C)
                    if bias:
                        sd[f"{b}{unit}.leaky_average.linear.bias"] = vec(C)
                    w = nh(leak())
                    sd[f"{b}{unit}.leaky_average.leaky_beta_w_under"] = w
                    sd[f"{b}{unit}.leaky_average.leaky_beta_u_under"] = w
                else:
                    sd[f"{b}{unit}.k_featurizer.conv.weight"] = mat(C, C)[..., None]
                    if bias:
                        sd[f"{b}{unit}.k_featurizer.conv.bias"] = vec(C)
                    sd[f"{b}{unit}.leaky_key_beta"] = nh(leak())
                sd[f"{b}{unit}.kernel_beta"] = nh(bandwidth())
                sd[f"{b}{unit}.value_beta"] = nh(scale())
                sd[f"{b}{unit}.c_proj.weight"] = mat(C, C)
                if bias:
                    sd[f"{b}{unit}.c_proj.bias"] = vec(C)
            sd[b + "attn.v_featurizer.linear.weight"] = mat(C, C)
            if bias:
                sd[b + "attn.v_featurizer.linear.bias"] = vec(C)
            sd[b + "attn.v_featurizer.coef"] = nh(_rand_scalars(H, -0.2, 1.2, g))
            if not attn_only:
                sd[b + "ln2.weight"] = 1 + vec(C)
                if bias:
                    sd[b + "ln2.bias"] = vec(C)
                for j in range(count):
                    sd[f"{b}pmem.pmem.M_k{j}"] = torch.randn(1, H, P, hs, generator=g) / math.sqrt(hs)
                    sd[f"{b}pmem.pmem.M_v{j}"] = torch.randn(1, H, P, hs, generator=g) / math.sqrt(hs)
        sd["ln_out.weight"] = 1 + vec(C)
        if bias:
            sd["ln_out.bias"] = vec(C)
    elif source == "nano":
        nh = lambda t: t.reshape(1, H, 1, 1)  # noqa: E731  nano per-head scalars are (1, H, 1, 1)
        sd["mosaic.wte.weight"] = emb
        sd["lm_head.weight"] = emb if tied else mat(V, C)
        T0 = 16  # block_size of the buffers (ignored by the converter)
        for i in range(L):
            b = f"mosaic.h.{i}."
            for n in ("1", "2"):
                sd[f"{b}ln_{n}.weight"] = 1 + vec(C)
                if bias:
                    sd[f"{b}ln_{n}.bias"] = vec(C)
            for unit in ("attn", "mlp"):
                kf = f"{b}{unit}.k_featurizer."
                sd[kf + "W_k.weight"] = mat(C, C)
                if bias:
                    sd[kf + "W_k.bias"] = vec(C)
                sd[kf + "leaky_avg.coef"] = torch.zeros(T0, T0)
                sd[kf + "leaky_avg.leaky_key_beta"] = nh(leak())
                sd[kf + "key_scale"] = nh(bandwidth())
                sd[f"{b}{unit}.c_proj.weight"] = mat(C, C)
                if bias:
                    sd[f"{b}{unit}.c_proj.bias"] = vec(C)
            sd[b + "attn.v_featurizer.W_v.weight"] = mat(C, C)
            if bias:
                sd[b + "attn.v_featurizer.W_v.bias"] = vec(C)
            sd[b + "attn.v_featurizer.coef"] = nh(_rand_scalars(H, -0.2, 1.2, g))
            sd[b + "attn.v_featurizer.val_scale"] = nh(scale())
            sd[b + "attn.bias"] = torch.ones(1, 1, T0, T0, dtype=torch.bool).tril(-1)
            sd[b + "mlp.P_k"] = torch.randn(count, 1, H, P, hs, generator=g) / math.sqrt(hs)
            sd[b + "mlp.P_v"] = torch.randn(count, 1, H, P, hs, generator=g) / math.sqrt(hs)
            sd[b + "mlp.out_scale"] = nh(scale())
        sd["mosaic.ln_f.weight"] = 1 + vec(C)
        if bias:
            sd["mosaic.ln_f.bias"] = vec(C)
    else:
        raise ValueError(source)
    return sd


# ------------------------------------------------------------------ the naive forward


class NaiveMemoryMosaics:
    """Official state dict -> logits, the slow obvious way. source: 'library' or 'nano'."""

    def __init__(self, sd: dict[str, torch.Tensor], source: str, pre_ln: bool = True,
                 nano_clamp: float = math.log(2**16 - 1)) -> None:
        self.sd = {k: v.to(F64) if v.is_floating_point() else v for k, v in sd.items()}
        self.source, self.pre_ln, self.nano_clamp = source, pre_ln, nano_clamp
        lib = source == "library"
        self.emb = self.sd["emb.weight" if lib else "mosaic.wte.weight"]
        self.head = self.sd["head.weight" if lib else "lm_head.weight"]
        self.C = self.emb.shape[1]
        prefix = "blocks." if lib else "mosaic.h."
        self.L = 1 + max(int(k[len(prefix):].split(".")[0]) for k in self.sd if k.startswith(prefix))
        probe = "blocks.0.attn.kernel_beta" if lib else "mosaic.h.0.attn.k_featurizer.key_scale"
        self.H = self.sd[probe].numel()
        self.eft = lib and "blocks.0.attn.leaky_average.linear.weight" in self.sd
        self.eps = 0.0 if lib else 1e-10  # Library: no epsilon; nano: +1e-10

    # -- small pieces

    def _get(self, name):
        return self.sd.get(name)

    def _linear(self, x, name):
        """x (T, C) @ W^T + b; Library key convs are (C, C, 1)."""
        w = self.sd[name + ".weight"]
        if w.dim() == 3:
            w = w[..., 0]
        y = x @ w.T
        b = self._get(name + ".bias")
        return y + b if b is not None else y

    def _ln(self, x, name):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + 1e-5) * self.sd[name + ".weight"]
        b = self._get(name + ".bias")
        return y + b if b is not None else y

    def _leaky_matrix(self, beta: float, T: int) -> torch.Tensor:
        """Dense (T, T) leaky-average matrix of this source, zero above the diagonal."""
        t = torch.arange(T, dtype=F64)
        lag = t[:, None] - t[None, :]
        A = torch.where(lag >= 0, torch.exp(-beta * lag.clamp(min=0)), torch.zeros((), dtype=F64))
        if self.eft:  # RWKV wkv kernel with k = 0, u = w: normalised exponential average
            return A / A.sum(dim=1, keepdim=True)
        if self.source == "library":  # regular: (1 - e^-beta) e^{-beta (t-j)}
            return A * (1 - math.exp(-beta))
        return A  # nano

    def _unit(self, x):
        return x / (x.norm(dim=-1, keepdim=True) + self.eps)

    def _keys(self, x, unit_prefix: str, power: int) -> list[torch.Tensor]:
        """Per head (T, hs) scaled keys of a key extractor; unit_prefix e.g. 'blocks.0.attn'."""
        T = x.shape[0]
        hs = self.C // self.H
        if self.source == "library":
            lin = unit_prefix + (".leaky_average.linear" if self.eft else ".k_featurizer.conv")
            rate = self.sd[unit_prefix + (".leaky_average.leaky_beta_w_under" if self.eft else ".leaky_key_beta")]
            bw = self.sd[unit_prefix + ".kernel_beta"]
        else:
            lin = unit_prefix + ".k_featurizer.W_k"
            rate = self.sd[unit_prefix + ".k_featurizer.leaky_avg.leaky_key_beta"]
            bw = self.sd[unit_prefix + ".k_featurizer.key_scale"]
        rate, bw = rate.reshape(-1), bw.reshape(-1)
        kt = self._linear(x, lin)
        out = []
        for h in range(self.H):
            beta = 10 * abs(float(rate[h]))
            kbar = self._leaky_matrix(beta, T) @ kt[:, h * hs:(h + 1) * hs]
            if self.source == "library":
                factor = math.exp(min(10 * float(bw[h]), 5.0)) ** power
            else:
                factor = math.exp(min(power * 10 * float(bw[h]), self.nano_clamp))
            out.append(self._unit(kbar) * factor)
        return out

    def _context(self, x, i: int):
        """Contextual memory layer i: (T, C) -> (T, C) and the per-head attention matrices."""
        T = x.shape[0]
        hs = self.C // self.H
        lib = self.source == "library"
        p = f"blocks.{i}.attn" if lib else f"mosaic.h.{i}.attn"
        keys = self._keys(x, p, power=1)
        vt = self._linear(x, p + (".v_featurizer.linear" if lib else ".v_featurizer.W_v"))
        coef = self.sd[p + ".v_featurizer.coef"].reshape(-1)
        vscale = self.sd[p + (".value_beta" if lib else ".v_featurizer.val_scale")].reshape(-1)
        ys, atts = [], []
        for h in range(self.H):
            v = vt[:, h * hs:(h + 1) * hs]
            v_next = torch.cat([v[1:], torch.zeros(1, hs, dtype=F64)])  # v~_T = 0
            c = float(coef[h])
            vals = self._unit(c * v + (1 - c) * v_next) * math.exp(10 * float(vscale[h]))
            k = keys[h]
            scores = k @ k.T  # (T, T)
            t = torch.arange(T)
            allowed = t[None, :] < t[:, None]  # j < t
            att = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            att[0] = 0.0  # row 0: empty memory (softmax of all -inf is NaN)
            ys.append(att @ vals)
            atts.append(att)
        y = torch.cat(ys, dim=1)
        return self._linear(y, p + ".c_proj"), atts

    def _persistent(self, x, i: int):
        lib = self.source == "library"
        p = f"blocks.{i}.pmem" if lib else f"mosaic.h.{i}.mlp"
        keys = self._keys(x, p, power=2)
        if lib:
            names = [k for k in self.sd if k.startswith(p + ".pmem.M_k")]
            names.sort(key=lambda k: int(k.rsplit("M_k", 1)[1]))
            mks = [self.sd[n][0] for n in names]
            mvs = [self.sd[n.replace("M_k", "M_v")][0] for n in names]
            oscale = self.sd[p + ".value_beta"].reshape(-1)
        else:
            mks, mvs = list(self.sd[p + ".P_k"][:, 0]), list(self.sd[p + ".P_v"][:, 0])
            oscale = self.sd[p + ".out_scale"].reshape(-1)
        ys = []
        for h in range(self.H):
            acc = 0
            for mk, mv in zip(mks, mvs):
                acc = acc + torch.softmax(keys[h] @ mk[h].T, dim=-1) @ mv[h]
            ys.append(acc / len(mks) * math.exp(10 * float(oscale[h])))
        return self._linear(torch.cat(ys, dim=1), p + ".c_proj")

    # -- public

    def forward(self, ids: torch.Tensor):
        """ids (T,) -> logits (T, V) float64 and attention matrices [layer][head] (T, T)."""
        lib = self.source == "library"
        x = self.emb[ids]
        attn_only = lib and not any(k.startswith("blocks.0.pmem.") for k in self.sd)
        all_atts = []
        for i in range(self.L):
            ln1 = f"blocks.{i}.ln1" if lib else f"mosaic.h.{i}.ln_1"
            ln2 = f"blocks.{i}.ln2" if lib else f"mosaic.h.{i}.ln_2"
            if self.pre_ln:
                y, atts = self._context(self._ln(x, ln1), i)
                x = x + y
                if not attn_only:
                    x = x + self._persistent(self._ln(x, ln2), i)
            else:
                x = self._ln(x, ln1)
                y, atts = self._context(x, i)
                x = x + y
                if not attn_only:
                    x = self._ln(x, ln2)
                    x = x + self._persistent(x, i)
            all_atts.append(atts)
        x = self._ln(x, "ln_out" if lib else "mosaic.ln_f")
        logits = x @ self.head.T
        if lib:
            logits = logits / math.sqrt(self.C)
        return logits, all_atts

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) -> (B, T, V) float64."""
        return torch.stack([self.forward(row)[0] for row in input_ids])

    def last_token_attention(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(n_layer, B, H, T): the last row of each attention matrix."""
        per_batch = []
        for row in input_ids:
            _, atts = self.forward(row)
            per_batch.append(torch.stack([torch.stack([a[-1] for a in layer]) for layer in atts]))  # (L, H, T)
        return torch.stack(per_batch, dim=1)
