"""OpenAI's /v1/responses API."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/v1", tags=["openai"])
