"""The user's keys, checked where they enter: the ``long_context`` schema (``schema``: pydantic, ``extra="forbid"``,
every error naming its key path and the fix), the shipped configs (``shipped``) and RoPE scaling (``rope_scaling``).
``ds_longctx.config.<name>`` keeps working for every name of the schema."""
from .schema import *  # noqa: F401,F403  (the schema's public names, as ds_longctx.config.* before the regroup)
