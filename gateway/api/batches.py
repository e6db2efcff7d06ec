"""OpenAI's /v1/batches API."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/v1", tags=["openai"])
