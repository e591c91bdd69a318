"""`tandem demo`: make the demo model once (cached), then show tandem working on it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from app.paths import ASSETS, cache_dir

log = logging.getLogger(__name__)
DEMO_PROMPT = "Tell me a story about a lighthouse keeper."


def demo_model_dir() -> str:
    """Make the demo model from `assets/demo-model.json` once; reuse it after."""
    from nodes.model.factory import MakeModelArgs, make_model

    recipe = json.loads((ASSETS / "demo-model.json").read_text())
    args = MakeModelArgs(**recipe)
    key = "-".join(str(v) for v in recipe.values())
    out = cache_dir() / "models" / f"demo-{abs(hash(key)) % 10**8:08d}"
    if not (out / "config.json").exists():
        log.info("making the demo model in %s", out)
        make_model(out, args)
    return str(out)


def run_demo(headless: bool = False) -> int:
    model = demo_model_dir()
    # The decode side lives in its own process: app/ never imports mlx.
    code = (
        "import sys; from mlx_lm import load, generate;"
        "m, t = load(sys.argv[1]);"
        "p = t.apply_chat_template([{'role': 'user', 'content': sys.argv[2]}],"
        " add_generation_prompt=True);"
        "print(generate(m, t, p, max_tokens=48))"
    )
    print(f"model: {model}\nprompt: {DEMO_PROMPT}")
    done = subprocess.run([sys.executable, "-c", code, model, DEMO_PROMPT], check=False)
    return done.returncode
