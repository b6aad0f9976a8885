# Helpers sourced by .ci/run and the .ci/*.sh stages.

# fresh_venv DIR: a new virtualenv at DIR with current pip, activated in this shell.
fresh_venv() {
  python3 -m venv "$1"
  # shellcheck disable=SC1091
  source "$1/bin/activate"
  pipq install -q --upgrade pip
}

# pipq ARGS: pip with its "Location ... is ignored" noise dropped; fails as pip fails.
pipq() {
  python -m pip --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
  return "${PIPESTATUS[0]}"
}

# print_stack LABEL: the resolved versions of the packages lpdiff's results depend on, as one log line.
print_stack() {
  python - "$1" <<'PY'
import importlib.metadata as md
import sys

names = ["torch", "triton", "transformers", "peft", "numpy", "tokenizers", "safetensors", "huggingface_hub",
         "accelerate", "pyarrow", "datasets", "pytest", "pytest-xdist", "kernels", "lpdiff"]
found = []
for n in names:
    try:
        found.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        pass
print(f"== stack {sys.argv[1]}: Python {sys.version.split()[0]} | " + " | ".join(found))
PY
}

# run_pytest ARGS: pytest that also fails when it collected nothing (exit code 5).
run_pytest() {
  local rc=0
  python -m pytest "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: that is a failure"; return 1; fi
  return "$rc"
}
