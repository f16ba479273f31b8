"""genlib's forward paths behind one interface (`base.Backend`), and the one place that
chooses between them (`choose.choose_backend`):

- transformers: the model's own forward over a dynamic cache (any model, any rows);
- lean: genlib's Llama forward in torch, one row (`llama.LeanLlama`);
- compiled: a one-token step under torch.compile (lean, or transformers' static cache);
- native: the lean step as one C kernel (`kernel.NativeStep`), float32 on a CPU.

Nothing is imported here, so `genlab --help` loads no torch.
"""
