"""The model runner: one batched forward per step, its attention, static decode and sampling."""
