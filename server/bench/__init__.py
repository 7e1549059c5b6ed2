"""The benchmarks behind `lethe bench ...` (their command line: `lethe.clients.cli.bench`), one module a bench:

    t3.py               `lethe bench t3`: T3's decoding overhead, speed against `model.generate`, training time
    engine.py           `lethe bench engine`: decode speed against `model.generate` and llama.cpp, with and without
                        a head
    engine_llamacpp.py  llama.cpp itself on a GGUF file, for `lethe bench engine`: run in a process of its own
                        (`python -m lethe.server.bench.engine_llamacpp ...`)
    quality.py          `lethe bench t3-quality` and `lethe bench asu-quality`: the quality tables
    real.py             `lethe bench real`: forgetting a topic a pretrained chat model knows, with fluency measured
    soak.py             `lethe bench soak`: a fixed-duration load run against a server
    heads.py            `lethe bench heads`: one client alone against N clients on N heads at once
    scale.py            `lethe bench scale`: 2 Ray Serve replicas against 1, and Ray's routing overhead
    attacks.py          `lethe bench attacks`: forgetting in contexts (system prompts, earlier turns, documents,
                        other languages, multiple choice) and under log-likelihood scoring, through the routes
    continual.py        `lethe bench continual`: forget requests one after another, each applied to a profile

Above `heads/` and `server/`: a bench may import both. The evaluation math they use (`evaluate`, `metrics`,
`scoring`, `facts`) stays in `lethe.heads.evaluation`. Heavy imports stay inside the functions that need them.
"""

from pathlib import Path


def shown_path(path) -> str:
    """A path as a report shows it: relative to the working directory when under it (reports are committed to
    docs/, and hold no machine's absolute paths), else its last two parts."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(Path(*path.parts[-2:]))
