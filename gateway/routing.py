"""Model id -> backend. The routing issue grows this into versioned routes and rules."""

from __future__ import annotations

from backends.base import Backend, ModelNotFound


class ModelRouter:
    def __init__(self, backends: dict[str, Backend]) -> None:
        self.backends = backends  # served model id -> backend

    def models(self) -> list[str]:
        return list(self.backends)

    def resolve(self, model: str | None) -> tuple[str, Backend]:
        if not model and len(self.backends) == 1:
            return next(iter(self.backends.items()))
        backend = self.backends.get(model or "")
        if backend is None:
            raise ModelNotFound(
                f"The model `{model}` does not exist. Available: {', '.join(self.backends) or 'none'}.",
                param="model",
            )
        return model, backend
