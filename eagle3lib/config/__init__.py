"""Typed parameters: one pydantic model per profile section, one file per stage.

`base.StageConfig` forbids unknown keys, so a misspelled key in a profile or a `--set` override is an error (papermill by
itself would only warn and run with the default).
"""
