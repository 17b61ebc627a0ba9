"""python -m serve [--model PATH] [--checkpoint PATH] [--prompt-style chat|plain] [--host 127.0.0.1]
[--port 8000] [--max-pending N] [--max-batch-tokens N] [--timeout S]; API keys from $LEV_API_KEYS."""
from lev_jax.server.cli import main

raise SystemExit(main())
