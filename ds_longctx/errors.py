"""The one error type for bad user input (imports nothing from ds_longctx: every module may raise it)."""


class ConfigError(ValueError):
    """A bad config or shape. The message names the key path and the fix."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"{key}: {problem}. Fix: {fix}")


__all__ = ["ConfigError"]
