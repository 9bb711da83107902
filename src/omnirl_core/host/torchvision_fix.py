"""Post-install step of an engine's CPU environment (``python -m omnirl_core.host.torchvision_fix``, listed in
the environment.toml of vllm-omni and vllm).

PyPI's torchvision wheels link against CUDA torch. Against vLLM's CPU torch its C++ ops do not load, and
``import torchvision`` then fails in ``_meta_registrations.py``, which registers fake kernels for
``torchvision::nms`` / ``qnms`` unconditionally ("operator torchvision::nms does not exist"). transformers'
Qwen2-VL code (imported by vLLM's model registry) needs torchvision's Python transforms, not its ops. This
step makes those two registrations conditional on the ops being loaded, as the file already does for the
others. Idempotent; it changes nothing where the ops load (a CUDA build on a GPU machine).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GUARD = "if torchvision.extension._has_ops():  # omnirl envfix\n"


def patch_torchvision() -> str:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return "torchvision not installed: nothing to do"
    path = Path(next(iter(spec.submodule_search_locations))) / "_meta_registrations.py"
    text = path.read_text()
    if GUARD in text:
        return f"{path}: already patched"
    out, changed = [], 0
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(('@torch.library.register_fake("torchvision::nms")',
                            '@torch.library.register_fake("torchvision::qnms")')):
            # indent the decorated function under the guard, up to the next top-level statement
            block = [line]
            i += 1
            while i < len(lines) and (lines[i].startswith((" ", "\t", "def ")) or not lines[i].strip()):
                if lines[i].strip() == "" and i + 1 < len(lines) and not lines[i + 1].startswith((" ", "\t")):
                    break
                block.append(lines[i])
                i += 1
            out.append(GUARD)
            out.extend("    " + b if b.strip() else b for b in block)
            changed += 1
            continue
        out.append(line)
        i += 1
    if changed != 2:
        raise SystemExit(f"{path}: expected the nms and qnms fake registrations, found {changed}; this "
                         "torchvision version needs another fix (see the plugin README)")
    path.write_text("".join(out))
    return f"{path}: nms/qnms fake kernels now registered only when torchvision's ops load"


if __name__ == "__main__":
    print(patch_torchvision())
    import torchvision  # noqa: F401 - the point of the fix

    sys.exit(0)
