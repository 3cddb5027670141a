#!/usr/bin/python3
"""Checks of the PyTorch reference itself. Run: /usr/bin/python3 tests/reference/test_gpt2_reference.py

A tiny model made with numpy (L=2, C=64, NH=4, V=300, T=16, B=2) goes through the CLI; then:
loss ~ ln V at small init, every gradient present and finite, logits equal to an independent
numpy forward (float64, per-head loops), causality, float64 finite differences against autograd
and against the CLI's fp32 gradients, and one AdamW step against the AdamW formula.
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
import gpt2_reference as ref  # noqa: E402

L, C, NH, V, MAXT, T, B = 2, 64, 4, 300, 32, 16, 2


def tiny_weights(seed=1, std=0.02):
    rng = np.random.default_rng(seed)
    w = {"wte.weight": rng.normal(0, std, (V, C)), "wpe.weight": rng.normal(0, std, (MAXT, C)),
         "ln_f.weight": 1 + rng.normal(0, 0.1, C), "ln_f.bias": rng.normal(0, 0.1, C)}
    for l in range(L):
        p = f"h.{l}."
        w[p + "ln_1.weight"] = 1 + rng.normal(0, 0.1, C)
        w[p + "ln_1.bias"] = rng.normal(0, 0.1, C)
        w[p + "attn.c_attn.weight"] = rng.normal(0, std, (C, 3 * C))
        w[p + "attn.c_attn.bias"] = rng.normal(0, std, 3 * C)
        w[p + "attn.c_proj.weight"] = rng.normal(0, std, (C, C))
        w[p + "attn.c_proj.bias"] = rng.normal(0, std, C)
        w[p + "ln_2.weight"] = 1 + rng.normal(0, 0.1, C)
        w[p + "ln_2.bias"] = rng.normal(0, 0.1, C)
        w[p + "mlp.c_fc.weight"] = rng.normal(0, std, (C, 4 * C))
        w[p + "mlp.c_fc.bias"] = rng.normal(0, std, 4 * C)
        w[p + "mlp.c_proj.weight"] = rng.normal(0, std, (4 * C, C))
        w[p + "mlp.c_proj.bias"] = rng.normal(0, std, C)
    return {k: v.astype(np.float32) for k, v in w.items()}


def numpy_forward(w, idx):
    """Independent float64 forward: explicit per-head loop, HF Conv1D layout."""
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def ln(x, g, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * g + b

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    Bn, Tn = idx.shape
    HS = C // NH
    x = w["wte.weight"][idx] + w["wpe.weight"][:Tn][None]
    for l in range(L):
        p = f"h.{l}."
        h = ln(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"])
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
        y = np.zeros_like(h)
        for b in range(Bn):
            for hh in range(NH):
                cols = slice(hh * HS, (hh + 1) * HS)
                for t in range(Tn):
                    s = k[b, :t + 1, cols] @ q[b, t, cols] / math.sqrt(HS)
                    a = np.exp(s - s.max())
                    a /= a.sum()
                    y[b, t, cols] = a @ v[b, :t + 1, cols]
        x = x + y @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = ln(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"])
        x = x + gelu(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"]) @ w[p + "mlp.c_proj.weight"] \
            + w[p + "mlp.c_proj.bias"]
    x = ln(x, w["ln_f.weight"], w["ln_f.bias"])
    return x @ w["wte.weight"].T


class ReferenceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = cls.tmp.name
        cls.model_dir = os.path.join(d, "model")
        os.makedirs(cls.model_dir)
        cls.w = tiny_weights()
        ref.save_safetensors(os.path.join(cls.model_dir, "model.safetensors"), cls.w)
        with open(os.path.join(cls.model_dir, "config.json"), "w") as f:
            json.dump({"n_layer": L, "n_head": NH, "n_embd": C, "vocab_size": V, "n_positions": MAXT}, f)
        rng = np.random.default_rng(2)
        toks = rng.integers(0, V, (B, T + 1)).astype(np.int32)
        cls.inputs, cls.targets = toks[:, :-1].copy(), toks[:, 1:].copy()
        cls.batch = os.path.join(d, "batch.safetensors")
        ref.save_safetensors(cls.batch, {"inputs": cls.inputs, "targets": cls.targets})
        cls.lr, cls.wd, cls.clip, cls.b1, cls.b2, cls.eps = 1e-3, 0.1, 0.05, 0.9, 0.95, 1e-8
        cls.out = os.path.join(d, "out.safetensors")
        cls.run_cli(cls.out, steps=5)
        cls.res, cls.meta = ref.load_safetensors(cls.out)
        cls.out1 = os.path.join(d, "out1.safetensors")
        cls.run_cli(cls.out1, steps=1, extra=["--dump-params"])
        cls.res1, _ = ref.load_safetensors(cls.out1)

    @classmethod
    def run_cli(cls, out, steps, extra=()):
        cmd = [sys.executable, os.path.join(HERE, "gpt2_reference.py"), "--model-dir", cls.model_dir,
               "--batch", cls.batch, "--out", out, "--adam-steps", str(steps), "--lr", str(cls.lr),
               "--beta1", str(cls.b1), "--beta2", str(cls.b2), "--eps", str(cls.eps),
               "--weight-decay", str(cls.wd), "--grad-clip", str(cls.clip), *extra]
        subprocess.run(cmd, check=True)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def model64(self):
        m = ref.GPT2(ref.GPT2Config(L, NH, C, V, MAXT)).double()
        m.load_numpy_(self.w)
        return m

    def test_outputs_present_and_finite(self):
        names = [n for n, _ in ref.GPT2(ref.GPT2Config(L, NH, C, V, MAXT)).named_parameters()]
        self.assertEqual(len(names), 4 + 12 * L)
        self.assertEqual(self.res["logits"].shape, (B, T, V))
        self.assertEqual(self.res["loss"].shape, (1,))
        self.assertEqual(self.res["adam_losses"].shape, (5,))
        for n in names:
            g = self.res["grad." + n]
            self.assertEqual(g.shape, self.w[n].shape, n)
            self.assertEqual(g.dtype, np.float32, n)
            self.assertTrue(np.isfinite(g).all(), n)
            self.assertGreater(np.abs(g).max(), 0, n)
        # wpe rows beyond T get no gradient
        self.assertEqual(np.abs(self.res["grad.wpe.weight"][T:]).max(), 0)

    def test_loss_near_ln_vocab(self):
        loss = float(self.res["loss"][0])
        self.assertLess(abs(loss - math.log(V)), 0.1, loss)
        # and it is the mean cross-entropy of the logits written
        lg = self.res["logits"].astype(np.float64).reshape(-1, V)
        lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
        ce = (lse - lg[np.arange(B * T), self.targets.reshape(-1)]).mean()
        self.assertAlmostEqual(loss, ce, places=5)

    def test_logits_match_independent_numpy(self):
        want = numpy_forward(self.w, self.inputs)
        err = np.abs(self.res["logits"] - want).max()
        self.assertLess(err, 1e-4, err)

    def test_float64_matches_numpy_at_large_weights(self):
        # Large weights make the activations O(1), where details (tanh vs erf GELU, eps, scale)
        # show: float64 torch and numpy must agree to rounding.
        w = tiny_weights(seed=5, std=0.3)
        m = ref.GPT2(ref.GPT2Config(L, NH, C, V, MAXT)).double()
        m.load_numpy_(w)
        got, _ = m(torch.from_numpy(self.inputs.astype(np.int64)))
        want = numpy_forward(w, self.inputs)
        self.assertGreater(np.abs(want).max(), 1.0)
        err = np.abs(got.detach().numpy() - want).max()
        self.assertLess(err, 1e-9 * np.abs(want).max(), err)

    def test_causal(self):
        m = self.model64()
        idx = torch.from_numpy(self.inputs.astype(np.int64))
        a, _ = m(idx)
        idx2 = idx.clone()
        idx2[:, 9] = (idx2[:, 9] + 1) % V
        b, _ = m(idx2)
        self.assertEqual((a[:, :9] - b[:, :9]).abs().max().item(), 0.0)
        self.assertGreater((a[:, 9:] - b[:, 9:]).abs().max().item(), 0.0)

    def test_finite_differences_float64(self):
        m = self.model64()
        idx = torch.from_numpy(self.inputs.astype(np.int64))
        tgt = torch.from_numpy(self.targets.astype(np.int64))
        _, loss = m(idx, tgt)
        loss.backward()
        params = dict(m.named_parameters())
        tok = int(self.inputs[0, 3])
        probes = [("h.1.attn.c_attn.weight", (3, 70)), ("h.0.attn.c_attn.weight", (10, 2 * C + 5)),
                  ("h.0.mlp.c_fc.weight", (7, 100)), ("wte.weight", (tok, 5)), ("wpe.weight", (2, 3)),
                  ("ln_f.bias", (7,)), ("h.1.ln_1.weight", (11,)), ("h.0.attn.c_proj.bias", (1,))]
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
            # the CLI's fp32 gradient agrees with the float64 one
            g32 = float(self.res["grad." + name][ix])
            tol = 1e-3 * p.grad.abs().max().item() + 1e-4 * abs(ad)
            self.assertLess(abs(g32 - ad), tol, f"{name}{ix}: fp32 {g32} fp64 {ad}")
        # whole tensors too
        for name, p in params.items():
            g64 = p.grad.numpy()
            err = np.abs(self.res["grad." + name] - g64).max()
            self.assertLess(err, 1e-4 * max(np.abs(g64).max(), 1e-6) + 1e-7, name)

    def test_adam_losses(self):
        losses = self.res["adam_losses"]
        self.assertAlmostEqual(float(losses[0]), float(self.res["loss"][0]), places=5)
        self.assertTrue(np.all(np.diff(losses) < 0), losses)
        self.assertTrue(np.all(self.res["adam_grad_norms"] > 0))

    def test_one_adamw_step_matches_formula(self):
        # Step 1 of AdamW: m_hat = g, v_hat = g^2, so p1 = p0*(1 - lr*wd_p) - lr * g / (|g| + eps),
        # with g the clipped gradient and wd_p = wd on 2-D tensors, 0 elsewhere.
        norm = float(self.res1["adam_grad_norms"][0])
        coef = min(1.0, self.clip / (norm + 1e-6))
        self.assertLess(coef, 1.0)  # the clip is active in this test
        total = math.sqrt(sum(float((self.res["grad." + n].astype(np.float64) ** 2).sum()) for n in self.w))
        self.assertAlmostEqual(norm / total, 1.0, places=4)
        for n, p0 in self.w.items():
            g = self.res["grad." + n].astype(np.float64) * coef
            wd = self.wd if p0.ndim == 2 else 0.0
            want = p0 * (1 - self.lr * wd) - self.lr * g / (np.abs(g) + self.eps)
            err = np.abs(self.res1["param." + n] - want).max()
            # sign of tiny gradients can flip between runs only where |g| ~ eps
            self.assertLess(err, 2e-6 + 1e-3 * self.lr, n)

    def test_safetensors_roundtrip_and_metadata(self):
        self.assertEqual(self.meta["producer"], "tests/reference/gpt2_reference.py")
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "x.safetensors")
            data = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, 2], np.int32),
                    "c": np.array([1.5], np.float64)}
            ref.save_safetensors(p, data, {"k": "v"})
            with open(p, "rb") as f:
                raw = f.read()
            n = int.from_bytes(raw[:8], "little")
            self.assertEqual((8 + n) % 8, 0)
            got, meta = ref.load_safetensors(p)
            self.assertEqual(meta, {"k": "v"})
            for k, v in data.items():
                np.testing.assert_array_equal(got[k], v)

    def test_init_and_optimizer_groups(self):
        m = ref.init_gpt2_(ref.GPT2(ref.GPT2Config(L, NH, C, V, MAXT)), seed=3)
        opt = ref.make_adamw(m, 1e-3, weight_decay=0.1)
        decay, nodecay = opt.param_groups
        self.assertEqual(decay["weight_decay"], 0.1)
        self.assertEqual(nodecay["weight_decay"], 0.0)
        self.assertEqual(len(decay["params"]), 2 + 4 * L)  # wte, wpe, 4 matrices per block
        self.assertEqual(len(nodecay["params"]), 2 + 8 * L)
        self.assertAlmostEqual(m.h[0].attn.c_proj.weight.std().item(), 0.02 / math.sqrt(2 * L), delta=0.002)


if __name__ == "__main__":
    unittest.main(verbosity=2)
