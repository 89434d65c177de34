"""From a config section to an installed model: the resolved setup every install trusts (``spec``), the checks of
config against model (``checks``, ``compat``), the SP batch path of the patched forward (``sp_batch``) and the
installs on a model, each undoable (``patch``)."""
