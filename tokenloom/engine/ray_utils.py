"""Ray, imported on demand (it is an extra: pip install 'tokenloom[ray]'), for the Ray engine cores
(ray_engine.py) and the Ray executor of their tensor/pipeline ranks (ray_executor.py); a leaf, so that
neither imports the other for it."""

from __future__ import annotations

from typing import Any

from tokenloom.engine.exceptions import EngineStartError


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise EngineStartError(
            "--distributed-executor-backend ray needs Ray: pip install 'tokenloom[ray]'"
        ) from exc
    return ray
