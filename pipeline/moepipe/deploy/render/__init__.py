"""The deployment folder of a target: ``<deploy>/model_repo`` rendered strictly from
``model_repo/`` (:mod:`.templates`) with the target's values (:mod:`.targets`), the optional
fallback model (:mod:`.fallback`), the tokenizer and the cluster files. The face:
:func:`moepipe.deploy.render.repository.render_deployment`."""
