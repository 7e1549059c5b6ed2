"""Decoding: batched prefill and one-token steps with a KV cache (`decode`), and per-row sampling (`sampling`)."""
