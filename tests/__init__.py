"""lpdiff's own tests, in folders that mirror the product tree. Every folder is a package (an ``__init__.py``), so
that files of the same name in different folders (tests/engines/hf/test_engine.py, tests/engines/vllm/test_engine.py)
import under pytest's default "prepend" mode as ``tests.engines.hf.test_engine`` ...; the checkout's root, where the
root conftest.py sits, is then what pytest puts on sys.path, and ``tests.helpers`` imports from any depth. Shared
code lives in tests/helpers/: no test file imports another (tests/test_import_rules.py)."""
