"""The best plain PyTorch offers, as a benchmark peer: GPT-2 over a static KV cache with SDPA,
the whole decode step (layers, lm_head, argmax) under torch.compile(mode="reduce-overhead")
(Inductor's Triton kernels + CUDA graphs). Greedy only; same weights dict as minillm."""
import torch
import torch.nn.functional as F


class TorchPeer:
    def __init__(self, config, weights, batch, max_len=None):
        self.c, self.w = config, weights
        c = config
        L = max_len or c.n_positions
        shape = (c.n_layer, batch, c.n_head, L, c.head_dim)
        dev, dt = weights["wte.weight"].device, weights["wte.weight"].dtype
        self.k = torch.zeros(shape, device=dev, dtype=dt)
        self.v = torch.zeros(shape, device=dev, dtype=dt)
        self.positions = torch.arange(L, device=dev)
        # a static address: the cache is mutated inside the graph without breaking CUDA graphs
        torch._dynamo.mark_static_address(self.k)
        torch._dynamo.mark_static_address(self.v)
        # static shapes: every batch size gets its own graph, as in a script that runs one. Left
        # to itself, Dynamo recompiles a second TorchPeer's step with a dynamic batch dimension
        self.step = torch.compile(self._decode, mode="reduce-overhead", fullgraph=True, dynamic=False)

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

    def _head(self, x):
        x = F.layer_norm(x, (self.c.n_embd,), self.w["ln_f.weight"], self.w["ln_f.bias"], self.c.layer_norm_epsilon)
        head = self.w.get("lm_head.weight", self.w["wte.weight"])  # tied unless the checkpoint has its own
        return (x @ head.t()).argmax(-1)

    def prefill(self, ids):
        """ids (B, T), all of one length (the benchmark's prompts). Returns next ids (B,)."""
        B, T = ids.shape
        x = self.w["wte.weight"][ids] + self.w["wpe.weight"][:T]

        def attend(i, q, k, v):
            self.k[i, :, :, :T], self.v[i, :, :, :T] = k, v
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        for i in range(self.c.n_layer):
            x = self._block(i, x, attend)
        return self._head(x[:, -1])

    def _decode(self, tokens, pos):
        """tokens (B,), pos () int64 tensor: one step for all rows at the same position."""
        x = (self.w["wte.weight"][tokens] + self.w["wpe.weight"].index_select(0, pos.view(1)))[:, None]  # (B, 1, C)
        mask = (self.positions <= pos)[None, None, None, :]  # (1, 1, 1, L)

        def attend(i, q, k, v):
            self.k[i].index_copy_(2, pos.view(1), k)
            self.v[i].index_copy_(2, pos.view(1), v)
            return F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask)

        for i in range(self.c.n_layer):
            x = self._block(i, x, attend)
        return self._head(x[:, 0])

    def generate(self, ids, new_tokens):
        tok = self.prefill(ids)
        pos = torch.tensor(ids.shape[1], device=ids.device)
        out = [tok]
        for _ in range(new_tokens - 1):
            tok = self.step(tok, pos).clone()
            pos += 1
            out.append(tok)
        return torch.stack(out, 1)
