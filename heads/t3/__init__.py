"""T3 (Temper-Then-Tilt): the head and its file (`head`), the pooled-state cache (`cache`), fitting (`train`),
the end-to-end pipeline (`pipeline`), the tilt on logits (`tilt`), per-row heads in a batch (`guide`), the
CPU kernel of a decoding step (`fused`), and importing the public reference's heads (`reference`)."""
