"""The best plain PyTorch offers, as a benchmark peer: GPT-2 over a static KV cache with SDPA,
the whole decode step (layers, lm_head, argmax or draw) compiled by torch.compile (Inductor's Triton
kernels) and replayed as one CUDA graph per step. That is what mode="reduce-overhead" does,
without its per-call Python work (guards, cudagraph-tree bookkeeping): at GPT-2's size that work
outlasted the GPU's (0.56 to 1.8 ms a step, by host), so the peer's speed followed the host.
Greedy, or sampled as transformers samples (its processors in plain torch, compiled with the
step, and the draw torch.multinomial makes: argmax(p / q), q ~ Exp(1) drawn in the graph). Same
weights dict as minillm."""
import torch
import torch.nn.functional as F

from . import own_kernels  # noqa: F401  (first: checks that `kernels` is minillm's)
from kernels.reference import sampling_scores

from .graphs import capture


class TorchPeer:
    def __init__(self, config, weights, batch, max_len=None, sampling=None):
        """sampling: None (greedy) or dict(temperature=, top_k=, top_p=), temperature > 0."""
        self.c, self.w, self.sampling = config, weights, sampling
        c = config
        L = max_len or c.n_positions
        shape = (batch, c.n_head, L, c.head_dim)
        dev, dt = weights["wte.weight"].device, weights["wte.weight"].dtype
        # one tensor per layer, written gpt-fast style (cache[:, :, pos] = k): Inductor then writes
        # the new row in place. Views of one (n_layer, ...) tensor made it copy the whole cache
        # back after every step (1.6 ms of a 2.7 ms step at batch 64 on an H200)
        self.k = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(c.n_layer)]
        self.v = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(c.n_layer)]
        self.positions = torch.arange(L, device=dev)
        # static shapes: every batch size gets its own graph, as in a script that runs one. Left
        # to itself, Dynamo recompiles a second TorchPeer's step with a dynamic batch dimension
        self.compiled = torch.compile(self._decode, fullgraph=True, dynamic=False)
        # the step graph's state: the last ids and their position; every id by position in out
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.out = torch.zeros(batch, L, dtype=torch.long, device=dev)
        self.q = torch.empty(batch, c.vocab_size, device=dev) if sampling else None  # the step's draw
        self.first = 0  # position of start()'s ids
        self.graph = None

    def _block(self, i, x, attend):
        c, w, p = self.c, self.w, f"h.{i}."
        B, T, C = x.shape
        a = F.layer_norm(x, (C,), w[p + "ln_1.weight"], w[p + "ln_1.bias"], c.layer_norm_epsilon)
        qkv = torch.addmm(w[p + "attn.c_attn.bias"], a.view(B * T, C), w[p + "attn.c_attn.weight"])
        q, k, v = qkv.view(B, T, 3, c.n_head, c.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        y = attend(i, q, k, v).transpose(1, 2).reshape(B * T, C)
        x = x + torch.addmm(w[p + "attn.c_proj.bias"], y, w[p + "attn.c_proj.weight"]).view(B, T, C)
        m = F.layer_norm(x, (C,), w[p + "ln_2.weight"], w[p + "ln_2.bias"], c.layer_norm_epsilon)
        f = F.gelu(torch.addmm(w[p + "mlp.c_fc.bias"], m.view(B * T, C), w[p + "mlp.c_fc.weight"]), approximate="tanh")
        return x + torch.addmm(w[p + "mlp.c_proj.bias"], f, w[p + "mlp.c_proj.weight"]).view(B, T, C)

    def _head(self, x, q):
        x = F.layer_norm(x, (self.c.n_embd,), self.w["ln_f.weight"], self.w["ln_f.bias"], self.c.layer_norm_epsilon)
        head = self.w.get("lm_head.weight", self.w["wte.weight"])  # tied unless the checkpoint has its own
        logits = x @ head.t()
        if not self.sampling:
            return logits.argmax(-1)
        s = self.sampling
        probs = torch.softmax(sampling_scores(logits, s["temperature"], s["top_k"], s["top_p"]), dim=-1)
        return (probs / q).argmax(-1)

    def _draw(self):
        """q for the next token (sampled runs): from the default generator, as multinomial draws."""
        return self.q.exponential_(1) if self.sampling else None

    def prefill(self, ids):
        """ids (B, T), all of one length (the benchmark's prompts). Returns next ids (B,)."""
        B, T = ids.shape
        x = self.w["wte.weight"][ids] + self.w["wpe.weight"][:T]

        def attend(i, q, k, v):
            self.k[i][:, :, :T], self.v[i][:, :, :T] = k, v
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        for i in range(self.c.n_layer):
            x = self._block(i, x, attend)
        return self._head(x[:, -1], self._draw())

    def _decode(self, tokens, pos, q):
        """tokens (B,), pos () int64 tensor, q (B, V) or None: one step for all rows at the same
        position."""
        x = (self.w["wte.weight"][tokens] + self.w["wpe.weight"].index_select(0, pos.view(1)))[:, None]  # (B, 1, C)
        mask = (self.positions <= pos)[None, None, None, :]  # (1, 1, 1, L)

        def attend(i, q, k, v):
            self.k[i][:, :, pos.view(1)] = k
            self.v[i][:, :, pos.view(1)] = v
            return F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask)

        for i in range(self.c.n_layer):
            x = self._block(i, x, attend)
        return self._head(x[:, 0], q)

    def _capture(self):
        """Compile and warm up at the current (tok, pos), then capture one step: the next ids
        into tok and into out at pos + 1, then pos + 1. The warm-up steps write the same cache
        row the first real step writes."""
        def step():
            self.tok.copy_(self.compiled(self.tok, self.pos, self._draw()))
            self.pos.add_(1)
            self.out.index_copy_(1, self.pos.view(1), self.tok[:, None])

        self.graph, _ = capture(step, warmups=2, warm=lambda: self.compiled(self.tok, self.pos, self.q))

    def start(self, ids):
        """Prefill prompts ids (B, T); returns the first new ids (B,), where the steps go on from."""
        tok = self.prefill(ids)
        self.first = ids.shape[1]
        self.tok.copy_(tok)
        self.pos.fill_(self.first)
        return tok

    def decode(self, steps):
        """`steps` more ids per row, one graph replay each, recorded on the device: a (B, steps)
        view of out, which the next start() overwrites."""
        room = self.out.shape[1] - 1 - self.first
        if steps > room:
            raise ValueError(f"steps: expected at most {room} for this cache length, got {steps}")
        if self.graph is None:
            self._capture()
        for _ in range(steps):
            self.graph.replay()
        return self.out[:, self.first + 1:self.first + 1 + steps]

    def generate(self, ids, new_tokens):
        first = self.start(ids)
        return torch.cat([first[:, None], self.decode(new_tokens - 1)], 1)
