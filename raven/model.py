"""The base of every settings model (the configuration files, the layer-3 sections, the install answers): frozen,
and closed to keys it does not know (``extra="forbid"``; raven/unknownkeys.py words the refusal)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
