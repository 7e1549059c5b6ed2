"""ASU (Attention Smoothing Unlearning): tempered attention for the teacher (`attention`), self-distillation
of adapters (`distill`), and the weights file, its checks and attaching it to a served model (`weights`)."""
