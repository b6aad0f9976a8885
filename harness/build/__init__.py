"""Builders of the tiny zoo: the models (``zoo``: configs, corpus and tokenizer, training, conditioning; ``python -m
lpdiff.harness.build.zoo build|measure``), the committed adapters and the trainers' adapters (``adapter_zoo``), and
what the zoo is measured by (``zoo_measure``). They write what harness/zoo/ and harness/zoo_adapters/ hold; a run,
a check or an engine only reads those files through spec/ (catalog, resolve) and never imports this package.

Where it sits in the import staircase (tests/test_import_rules.py): build -> spec -> kernels-free vocabulary, beside
engines rather than in the chain. It imports only harness.spec and harness.types (the catalog's names, adapter
generation, routing scores, prompt sets); of the product, only the CLI (``lpdiff calibrate`` reads which zoo models
carry MoE adapters) imports it, so no layer below the CLI depends on the builders and no cycle can form.
"""
