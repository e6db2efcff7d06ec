"""Model id -> backend. The routing issue grows this into versioned routes and rules."""

from __future__ import annotations

from backends.base import Backend, ModelNotFound


class ModelRouter:
    def __init__(self, backends: dict[str, Backend]) -> None:
        self.backends = backends  # served model id -> backend

    def models(self) -> list[str]:
        return list(self.backends)

    def resolve(self, model: str | None, visible: list[str]) -> tuple[str, Backend]:
        """The backend for `model` among the `visible` ones (optional when only one is). Models
        the caller may not use are reported as missing, never as forbidden."""
        if not model and len(visible) == 1:
            model = visible[0]
        if model not in visible:
            raise ModelNotFound(f"The model `{model}` does not exist or you do not have access to it. "
                                f"Available: {', '.join(visible) or 'none'}.", param="model")
        return model, self.backends[model]
