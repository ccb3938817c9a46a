"""LoRA adapters on the base model: configuration, adapter weights, loading, per-row deltas.

Several adapters (and the base model) share one step: each row of the batch
names its adapter slot, the LoRA-wrapped linear layers add
`scaling * B[slot] @ (A[slot] @ x)` to the base output (Punica's shrink then
expand). See `config.LoRAConfig` for vLLM 0.33's limits.
"""
