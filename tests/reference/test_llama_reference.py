#!/usr/bin/python3
"""Checks of the PyTorch LLaMA reference itself. Run: /usr/bin/python3 tests/reference/test_llama_reference.py

Tiny models made with numpy (L=2, C=64, NH=4, NKV=2, F=160, V=300, T=16, B=2; one untied, one
tied) go through the CLI; then: every output written with its shape, loss ~ ln V at small init,
logits equal to an independent numpy forward (float64, per-head loops, rotary embedding written
as rotations of the pairs (i, i + HS/2)), grouped-query attention equal to multi-head attention
with the kv heads copied out, rotary scores depending only on the position difference, causality,
float64 finite differences against autograd and against the CLI's fp32 gradients, the tied
head's gradient landing in the embedding, one AdamW step against the AdamW formula, and the
config.json checks.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import llama_reference as ref  # noqa: E402

L, C, NH, NKV, FF, V, MAXT, T, B = 2, 64, 4, 2, 160, 300, 32, 16, 2
HS = C // NH
THETA, EPS = 10000.0, 1e-5


def config(tied=False, nkv=NKV, **over):
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": C,
         "intermediate_size": FF, "num_hidden_layers": L, "num_attention_heads": NH,
         "num_key_value_heads": nkv, "rms_norm_eps": EPS, "rope_theta": THETA,
         "max_position_embeddings": MAXT, "tie_word_embeddings": tied, "hidden_act": "silu",
         "attention_bias": False, "torch_dtype": "float32"}
    d.update(over)
    return d


def tiny_weights(seed=1, std=0.02, tied=False, nkv=NKV):
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.normal(0, std, (V, C)),
         "model.norm.weight": 1 + rng.normal(0, 0.1, C)}
    if not tied:
        w["lm_head.weight"] = rng.normal(0, std, (V, C))
    for l in range(L):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = 1 + rng.normal(0, 0.1, C)
        w[p + "self_attn.q_proj.weight"] = rng.normal(0, std, (NH * HS, C))
        w[p + "self_attn.k_proj.weight"] = rng.normal(0, std, (nkv * HS, C))
        w[p + "self_attn.v_proj.weight"] = rng.normal(0, std, (nkv * HS, C))
        w[p + "self_attn.o_proj.weight"] = rng.normal(0, std, (C, NH * HS))
        w[p + "post_attention_layernorm.weight"] = 1 + rng.normal(0, 0.1, C)
        w[p + "mlp.gate_proj.weight"] = rng.normal(0, std, (FF, C))
        w[p + "mlp.up_proj.weight"] = rng.normal(0, std, (FF, C))
        w[p + "mlp.down_proj.weight"] = rng.normal(0, std, (C, FF))
    return {k: v.astype(np.float32) for k, v in w.items()}


def numpy_forward(w, idx, nkv=NKV, tied=False):
    """Independent float64 forward: per-head, per-position loops; rotary embedding as a rotation
    of each pair (i, i + HS/2) by t * theta^(-2i/HS); query head h reads kv head h // (NH/nkv)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * g

    def rotate(x, t):  # x (HS,) at position t
        h = HS // 2
        out = np.empty_like(x)
        for i in range(h):
            a = t * THETA ** (-2.0 * i / HS)
            c, s = math.cos(a), math.sin(a)
            out[i] = x[i] * c - x[i + h] * s
            out[i + h] = x[i + h] * c + x[i] * s
        return out

    Bn, Tn = idx.shape
    rep = NH // nkv
    x = w["model.embed_tokens.weight"][idx]
    for l in range(L):
        p = f"model.layers.{l}."
        hdn = rms(x, w[p + "input_layernorm.weight"])
        q = hdn @ w[p + "self_attn.q_proj.weight"].T
        k = hdn @ w[p + "self_attn.k_proj.weight"].T
        v = hdn @ w[p + "self_attn.v_proj.weight"].T
        y = np.zeros((Bn, Tn, NH * HS))
        for b in range(Bn):
            for hh in range(NH):
                qc = slice(hh * HS, (hh + 1) * HS)
                kc = slice((hh // rep) * HS, (hh // rep + 1) * HS)
                kr = np.stack([rotate(k[b, t, kc], t) for t in range(Tn)])
                for t in range(Tn):
                    s = kr[:t + 1] @ rotate(q[b, t, qc], t) / math.sqrt(HS)
                    a = np.exp(s - s.max())
                    a /= a.sum()
                    y[b, t, qc] = a @ v[b, :t + 1, kc]
        x = x + y @ w[p + "self_attn.o_proj.weight"].T
        hdn = rms(x, w[p + "post_attention_layernorm.weight"])
        g = hdn @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (hdn @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]
    return x @ head.T


def write_model(d, weights, cfg):
    os.makedirs(d, exist_ok=True)
    ref.save_safetensors(os.path.join(d, "model.safetensors"), weights)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


class LlamaReferenceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = cls.tmp.name
        cls.model_dir = os.path.join(d, "model")
        cls.w = tiny_weights()
        write_model(cls.model_dir, cls.w, config())
        cls.tied_dir = os.path.join(d, "tied")
        cls.wt = tiny_weights(seed=3, tied=True)
        write_model(cls.tied_dir, cls.wt, config(tied=True))
        rng = np.random.default_rng(2)
        toks = rng.integers(0, V, (B, T + 1)).astype(np.int32)
        cls.inputs, cls.targets = toks[:, :-1].copy(), toks[:, 1:].copy()
        cls.batch = os.path.join(d, "batch.safetensors")
        ref.save_safetensors(cls.batch, {"inputs": cls.inputs, "targets": cls.targets})
        cls.lr, cls.wd, cls.clip, cls.b1, cls.b2, cls.eps = 1e-3, 0.1, 0.05, 0.9, 0.95, 1e-8
        cls.out = os.path.join(d, "out.safetensors")
        cls.run_cli(cls.model_dir, cls.out, steps=5)
        cls.res, cls.meta = ref.load_safetensors(cls.out)
        cls.out1 = os.path.join(d, "out1.safetensors")
        cls.run_cli(cls.model_dir, cls.out1, steps=1, extra=["--dump-params"])
        cls.res1, _ = ref.load_safetensors(cls.out1)
        cls.outt = os.path.join(d, "outt.safetensors")
        cls.run_cli(cls.tied_dir, cls.outt, steps=2, extra=["--dump-params"])
        cls.rest, _ = ref.load_safetensors(cls.outt)

    @classmethod
    def cli(cls, model_dir, out, steps, extra=()):
        return [sys.executable, os.path.join(HERE, "llama_reference.py"), "--model-dir", model_dir,
                "--batch", cls.batch, "--out", out, "--adam-steps", str(steps), "--lr", str(cls.lr),
                "--beta1", str(cls.b1), "--beta2", str(cls.b2), "--eps", str(cls.eps),
                "--weight-decay", str(cls.wd), "--grad-clip", str(cls.clip), *extra]

    @classmethod
    def run_cli(cls, model_dir, out, steps, extra=()):
        subprocess.run(cls.cli(model_dir, out, steps, extra), check=True)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @staticmethod
    def cfg(tied=False, nkv=NKV):
        return ref.LlamaConfig.from_dict(config(tied=tied, nkv=nkv))

    def model64(self, w=None, tied=False, nkv=NKV, rope_dtype=torch.float32):
        m = ref.Llama(self.cfg(tied, nkv), rope_dtype=rope_dtype).double()
        m.load_numpy_(self.w if w is None else w)
        return m

    def idx(self):
        return torch.from_numpy(self.inputs.astype(np.int64))

    def tgt(self):
        return torch.from_numpy(self.targets.astype(np.int64))

    # ------------------------------------------------------------ outputs of the command line

    def test_outputs_written_with_shapes(self):
        names = [n for n, _ in ref.Llama(self.cfg()).named_parameters()]
        self.assertEqual(sorted(names), sorted(self.w))
        self.assertEqual(len(names), 3 + 9 * L)
        want = {"logits", "loss", "adam_losses", "adam_grad_norms"} | {"grad." + n for n in names}
        self.assertEqual(set(self.res), want)
        self.assertEqual(set(self.res1), want | {"param." + n for n in names})
        self.assertEqual(self.res["logits"].shape, (B, T, V))
        self.assertEqual(self.res["loss"].shape, (1,))
        self.assertEqual(self.res["adam_losses"].shape, (5,))
        self.assertEqual(self.res["adam_grad_norms"].shape, (5,))
        for n in names:
            for key, res in (("grad." + n, self.res), ("param." + n, self.res1)):
                a = res[key]
                self.assertEqual(a.shape, self.w[n].shape, key)
                self.assertEqual(a.dtype, np.float32, key)
                self.assertTrue(np.isfinite(a).all(), key)
            self.assertGreater(np.abs(self.res["grad." + n]).max(), 0, n)
        self.assertEqual(self.meta["producer"], "tests/reference/llama_reference.py")
        # without --adam-steps: logits, loss and gradients only
        out0 = os.path.join(self.tmp.name, "out0.safetensors")
        self.run_cli(self.model_dir, out0, steps=0)
        res0, _ = ref.load_safetensors(out0)
        self.assertEqual(set(res0), {"logits", "loss"} | {"grad." + n for n in names})
        np.testing.assert_array_equal(res0["logits"], self.res["logits"])

    def test_loss_near_ln_vocab(self):
        loss = float(self.res["loss"][0])
        self.assertLess(abs(loss - math.log(V)), 0.1, loss)
        lg = self.res["logits"].astype(np.float64).reshape(-1, V)
        lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
        ce = (lse - lg[np.arange(B * T), self.targets.reshape(-1)]).mean()
        self.assertAlmostEqual(loss, ce, places=5)

    # ------------------------------------------------------------ the forward pass

    def test_logits_match_independent_numpy(self):
        want = numpy_forward(self.w, self.inputs)
        err = np.abs(self.res["logits"] - want).max()
        self.assertLess(err, 1e-4, err)
        want_t = numpy_forward(self.wt, self.inputs, tied=True)
        err = np.abs(self.rest["logits"] - want_t).max()
        self.assertLess(err, 1e-4, err)

    def test_float64_matches_numpy_at_large_weights(self):
        # Large weights make the activations O(1), where details (rope pairing and frequencies,
        # eps, scale, silu, GQA head mapping) show: float64 torch (rotary angles in float64 too)
        # and numpy must agree to rounding.
        for nkv in (NKV, NH, 1):
            w = tiny_weights(seed=5, std=0.3, nkv=nkv)
            m = self.model64(w, nkv=nkv, rope_dtype=torch.float64)
            got, _ = m(self.idx())
            want = numpy_forward(w, self.inputs, nkv=nkv)
            self.assertGreater(np.abs(want).max(), 1.0)
            err = np.abs(got.detach().numpy() - want).max()
            self.assertLess(err, 1e-9 * np.abs(want).max(), (nkv, err))

    def test_gqa_equals_mha_with_kv_heads_copied(self):
        # NKV == NH: no repetition at all; the reference equals a plain multi-head attention
        # written here with torch (no repeat_kv, no GQA code path).
        w = tiny_weights(seed=6, std=0.3, nkv=NH)
        m = self.model64(w, nkv=NH)
        x = torch.randn(B, T, C, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        attn = m.model.layers[0].self_attn
        cos, sin = ref.rope_cos_sin(T, HS, THETA, torch.float64)
        got = attn(x, cos, sin)
        q = (x @ attn.q_proj.weight.T).view(B, T, NH, HS)
        k = (x @ attn.k_proj.weight.T).view(B, T, NH, HS)
        v = (x @ attn.v_proj.weight.T).view(B, T, NH, HS)
        y = torch.zeros(B, T, NH, HS, dtype=torch.float64)
        for hh in range(NH):
            qh = ref.apply_rope(q[:, :, hh], cos, sin)
            kh = ref.apply_rope(k[:, :, hh], cos, sin)
            s = qh @ kh.transpose(1, 2) / math.sqrt(HS)
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            y[:, :, hh] = s.softmax(-1) @ v[:, :, hh]
        want = y.reshape(B, T, C) @ attn.o_proj.weight.T
        self.assertLess((got - want).abs().max().item(), 1e-12)
        # NKV < NH: the GQA model equals the MHA model whose k/v rows for query head h are
        # those of kv head h // (NH/NKV).
        for nkv in (NKV, 1):
            wg = tiny_weights(seed=7, std=0.3, nkv=nkv)
            rep = NH // nkv
            wm = dict(wg)
            for l in range(L):
                for proj in ("k_proj", "v_proj"):
                    key = f"model.layers.{l}.self_attn.{proj}.weight"
                    wm[key] = np.concatenate([wg[key][(hh // rep) * HS:(hh // rep + 1) * HS] for hh in range(NH)])
            a, _ = self.model64(wg, nkv=nkv)(self.idx())
            b, _ = self.model64(wm, nkv=NH)(self.idx())
            self.assertLess((a - b).abs().max().item(), 1e-12 * b.abs().max().item())

    def test_rope_scores_depend_only_on_position_difference(self):
        g = torch.Generator().manual_seed(1)
        n = 64
        cos, sin = ref.rope_cos_sin(n, HS, THETA, torch.float64)
        q, k = torch.randn(HS, dtype=torch.float64, generator=g), torch.randn(HS, dtype=torch.float64, generator=g)
        qr = ref.apply_rope(q.expand(n, HS), cos, sin)  # q at every position
        kr = ref.apply_rope(k.expand(n, HS), cos, sin)
        s = qr @ kr.T  # s[m, j] = rot_m(q) . rot_j(k)
        for d in (-20, -3, 0, 1, 7, 40):
            diag = torch.diagonal(s, offset=-d)  # entries with m - j = d
            self.assertLess((diag - diag[0]).abs().max().item(), 1e-12, d)
        self.assertGreater((s[5, 0] - s[6, 0]).abs().item(), 1e-3)  # it does depend on the difference
        # position 0 is the identity; rotations keep the norm
        self.assertLess((qr[0] - q).abs().max().item(), 1e-15)
        self.assertLess((qr.norm(dim=1) - q.norm()).abs().max().item(), 1e-12)
        # Hugging Face's frequencies and the rotate_half pairing (i with i + HS/2)
        inv = 1.0 / THETA ** (np.arange(0, HS, 2) / HS)
        np.testing.assert_allclose(cos[3].numpy(), np.cos(3 * np.concatenate([inv, inv])), rtol=0, atol=1e-14)
        e = torch.zeros(HS, dtype=torch.float64)
        e[1] = 1.0
        r = ref.apply_rope(e.expand(n, HS), cos, sin)[2]
        want = torch.zeros(HS, dtype=torch.float64)
        want[1], want[1 + HS // 2] = math.cos(2 * inv[1]), math.sin(2 * inv[1])
        self.assertLess((r - want).abs().max().item(), 1e-15)
        # float32 angles (Hugging Face's, the default) differ from float64 ones only by rounding
        c32, s32 = ref.rope_cos_sin(n, HS, THETA)
        self.assertEqual(c32.dtype, torch.float32)
        self.assertLess((c32.double() - cos).abs().max().item(), n * 2 ** -23)
        self.assertLess((s32.double() - sin).abs().max().item(), n * 2 ** -23)

    def test_rmsnorm_formula(self):
        norm = ref.RMSNorm(C, EPS).double()
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, C, dtype=torch.float64))
        x = torch.randn(3, C, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * norm.weight
        self.assertLess((norm(x) - want).abs().max().item(), 1e-14)
        # float32 in, float32 out
        self.assertEqual(ref.RMSNorm(C, EPS)(x.float()).dtype, torch.float32)

    def test_causal(self):
        m = self.model64()
        idx = self.idx()
        a, _ = m(idx)
        idx2 = idx.clone()
        idx2[:, 9] = (idx2[:, 9] + 1) % V
        b, _ = m(idx2)
        self.assertEqual((a[:, :9] - b[:, :9]).abs().max().item(), 0.0)
        self.assertGreater((a[:, 9:] - b[:, 9:]).abs().max().item(), 0.0)

    def test_sequence_longer_than_max_positions_rejected(self):
        m = ref.Llama(self.cfg())
        with self.assertRaises(ValueError):
            m(torch.zeros(1, MAXT + 1, dtype=torch.int64))

    # ------------------------------------------------------------ gradients

    def test_finite_differences_float64(self):
        m = self.model64()
        idx, tgt = self.idx(), self.tgt()
        _, loss = m(idx, tgt)
        loss.backward()
        params = dict(m.named_parameters())
        tok = int(self.inputs[0, 3])
        probes = [("model.layers.1.self_attn.q_proj.weight", (3, 40)),
                  ("model.layers.0.self_attn.q_proj.weight", (HS + HS // 2 + 1, 5)),
                  ("model.layers.0.self_attn.k_proj.weight", (HS + 2, 9)),
                  ("model.layers.1.self_attn.v_proj.weight", (7, 60)),
                  ("model.layers.0.self_attn.o_proj.weight", (11, 50)),
                  ("model.layers.1.mlp.gate_proj.weight", (100, 4)), ("model.layers.0.mlp.up_proj.weight", (3, 63)),
                  ("model.layers.1.mlp.down_proj.weight", (2, 150)), ("model.embed_tokens.weight", (tok, 5)),
                  ("lm_head.weight", (int(self.targets[1, 2]), 7)), ("model.norm.weight", (7,)),
                  ("model.layers.1.input_layernorm.weight", (11,)),
                  ("model.layers.0.post_attention_layernorm.weight", (30,))]
        h = 1e-5
        for name, ix in probes:
            p = params[name]
            with torch.no_grad():
                orig = p[ix].item()
                p[ix] = orig + h
                lp = m(idx, tgt)[1].item()
                p[ix] = orig - h
                lm = m(idx, tgt)[1].item()
                p[ix] = orig
            fd = (lp - lm) / (2 * h)
            ad = p.grad[ix].item()
            scale = max(abs(fd), 1e-3 * p.grad.abs().max().item(), 1e-12)
            self.assertLess(abs(fd - ad) / scale, 1e-5, f"{name}{ix}: fd {fd} autograd {ad}")
            g32 = float(self.res["grad." + name][ix])
            tol = 1e-3 * p.grad.abs().max().item() + 1e-4 * abs(ad)
            self.assertLess(abs(g32 - ad), tol, f"{name}{ix}: fp32 {g32} fp64 {ad}")
        for name, p in params.items():
            g64 = p.grad.numpy()
            err = np.abs(self.res["grad." + name] - g64).max()
            self.assertLess(err, 1e-4 * max(np.abs(g64).max(), 1e-6) + 1e-7, name)

    def test_tied_head_gradient_in_embedding(self):
        names = [n for n, _ in ref.Llama(self.cfg(tied=True)).named_parameters()]
        self.assertNotIn("lm_head.weight", names)
        self.assertEqual(sorted(names), sorted(self.wt))
        self.assertNotIn("grad.lm_head.weight", self.rest)
        self.assertNotIn("param.lm_head.weight", self.rest)
        self.assertEqual(set(k for k in self.rest if k.startswith("grad.")), {"grad." + n for n in names})
        # The tied model equals the untied one with lm_head = embed_tokens, and its embedding
        # gradient is the untied embedding gradient plus the untied head gradient.
        tied = self.model64(self.wt, tied=True)
        wu = dict(self.wt)
        wu["lm_head.weight"] = self.wt["model.embed_tokens.weight"].copy()
        untied = self.model64(wu)
        lt, losst = tied(self.idx(), self.tgt())
        lu, lossu = untied(self.idx(), self.tgt())
        self.assertEqual((lt - lu).abs().max().item(), 0.0)
        losst.backward()
        lossu.backward()
        ge = untied.model.embed_tokens.weight.grad
        gh = untied.lm_head.weight.grad
        want = ge + gh
        got = tied.model.embed_tokens.weight.grad
        self.assertLess((got - want).abs().max().item(), 1e-14)
        # the head's part is not small next to the embedding's, so the test has teeth
        self.assertGreater(gh.abs().max().item(), 0.1 * ge.abs().max().item())
        err = np.abs(self.rest["grad.model.embed_tokens.weight"] - want.numpy()).max()
        self.assertLess(err, 1e-4 * want.abs().max().item(), err)
        # a tied model does not accept an lm_head tensor
        with self.assertRaises(ValueError):
            ref.Llama(self.cfg(tied=True)).load_numpy_(wu)
        # and an untied one wants it
        with self.assertRaises(ValueError):
            ref.Llama(self.cfg()).load_numpy_(self.wt)

    # ------------------------------------------------------------ AdamW

    def test_adam_losses(self):
        losses = self.res["adam_losses"]
        self.assertAlmostEqual(float(losses[0]), float(self.res["loss"][0]), places=5)
        self.assertTrue(np.all(np.diff(losses) < 0), losses)
        self.assertTrue(np.all(self.res["adam_grad_norms"] > 0))

    def test_one_adamw_step_matches_formula(self):
        # Step 1: p1 = p0*(1 - lr*wd_p) - lr * g / (|g| + eps), g the clipped gradient, wd_p = wd on
        # 2-D tensors (embedding, head, projections), 0 on the RMSNorm weights.
        norm = float(self.res1["adam_grad_norms"][0])
        coef = min(1.0, self.clip / (norm + 1e-6))
        self.assertLess(coef, 1.0)
        total = math.sqrt(sum(float((self.res["grad." + n].astype(np.float64) ** 2).sum()) for n in self.w))
        self.assertAlmostEqual(norm / total, 1.0, places=4)
        for n, p0 in self.w.items():
            g = self.res["grad." + n].astype(np.float64) * coef
            wd = self.wd if p0.ndim == 2 else 0.0
            want = p0 * (1 - self.lr * wd) - self.lr * g / (np.abs(g) + self.eps)
            err = np.abs(self.res1["param." + n] - want).max()
            self.assertLess(err, 2e-6 + 1e-3 * self.lr, n)

    def test_init_and_optimizer_groups(self):
        m = ref.init_llama_(ref.Llama(self.cfg()), seed=3)
        opt = ref.make_adamw(m, 1e-3, weight_decay=0.1)
        decay, nodecay = opt.param_groups
        self.assertEqual(decay["weight_decay"], 0.1)
        self.assertEqual(nodecay["weight_decay"], 0.0)
        self.assertEqual(len(decay["params"]), 2 + 7 * L)  # embedding, head, 7 matrices per layer
        self.assertEqual(len(nodecay["params"]), 1 + 2 * L)  # the RMSNorm weights
        for name, p in m.named_parameters():
            if p.dim() == 2:
                self.assertAlmostEqual(p.std().item(), 0.02, delta=0.002, msg=name)
            else:
                self.assertEqual(p.min().item(), 1.0, name)
                self.assertEqual(p.max().item(), 1.0, name)
        mt = ref.init_llama_(ref.Llama(self.cfg(tied=True)), seed=3)
        self.assertEqual(len(ref.make_adamw(mt, 1e-3).param_groups[0]["params"]), 1 + 7 * L)

    # ------------------------------------------------------------ config.json

    def test_config_keys_read(self):
        cfg = ref.LlamaConfig.from_dict(config(nkv=1, rope_theta=500000.0, rms_norm_eps=1e-6, tied=True))
        self.assertEqual((cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers),
                         (V, C, FF, L))
        self.assertEqual((cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim), (NH, 1, HS))
        self.assertEqual((cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings), (500000.0, 1e-6, MAXT))
        self.assertTrue(cfg.tie_word_embeddings)
        again = ref.LlamaConfig.from_dict(cfg.to_dict())
        self.assertEqual(vars(again), vars(cfg))
        # the values reach the model: eps and theta change the logits
        base, _ = self.model64()(self.idx())
        for over in ({"rms_norm_eps": 1e-1}, {"rope_theta": 100.0}):
            m = ref.Llama(ref.LlamaConfig.from_dict(config(**over))).double()
            m.load_numpy_(self.w)
            self.assertGreater((m(self.idx())[0] - base).abs().max().item(), 1e-6, over)

    def test_config_missing_key_names_it(self):
        for key in ref.LlamaConfig.REQUIRED:
            d = config()
            del d[key]
            with self.assertRaises(ValueError) as cm:
                ref.LlamaConfig.from_dict(d, source="x/config.json")
            self.assertIn(repr(key), str(cm.exception))
            self.assertIn("x/config.json", str(cm.exception))
        # through the command line: one line of error naming the key, no traceback
        d = os.path.join(self.tmp.name, "nokv")
        cfg = config()
        del cfg["num_key_value_heads"]
        write_model(d, self.w, cfg)
        p = subprocess.run(self.cli(d, os.path.join(self.tmp.name, "never.safetensors"), 0),
                           capture_output=True, text=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("'num_key_value_heads'", p.stderr)
        self.assertNotIn("Traceback", p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)

    def test_config_rejects_what_it_does_not_implement(self):
        bad = [{"model_type": "gpt2"}, {"hidden_act": "gelu"}, {"attention_bias": True}, {"mlp_bias": True},
               {"rope_scaling": {"type": "linear", "factor": 2.0}}, {"head_dim": 2 * HS},
               {"num_key_value_heads": 3}, {"hidden_size": 66}, {"tie_word_embeddings": "yes"},
               {"num_hidden_layers": 0}]
        for over in bad:
            with self.assertRaises(ValueError, msg=over):
                ref.LlamaConfig.from_dict(config(**over))
        # present and consistent is fine
        ref.LlamaConfig.from_dict(config(head_dim=HS, mlp_bias=False, rope_scaling=None))


if __name__ == "__main__":
    unittest.main(verbosity=2)
