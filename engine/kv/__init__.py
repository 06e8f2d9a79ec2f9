"""KV storage: the restored-S5 policy and the row pool that owns every K/V byte."""
