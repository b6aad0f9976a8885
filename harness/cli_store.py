"""``lpdiff baselines ...`` and ``lpdiff report``: the store's commands (list, prune, Hub pull/push/diff) and the
HTML report. Registered on the command tree in harness/cli.py, which keeps the exit-code contract."""

from __future__ import annotations

import click

from lpdiff.harness.cli_common import log


@click.group()
def baselines() -> None:
    """The baseline store: list, prune, and pull/push a Hub dataset copy (hf://datasets/ORG/NAME[@REV])."""


@baselines.command("ls")
@click.option("--baselines", "source", default=None, help="store dir or hf:// dataset (default: lpdiff's store)")
def baselines_ls(source) -> int:
    """Every entry of a store: what it computed, when."""
    from lpdiff.harness.pipeline.references import default_store

    store = default_store(source)
    entries = store.ls()
    for e in entries:
        click.echo(e.describe())
    log(f"{len(entries)} file(s) in {store.root}")
    return 0


@baselines.command("prune")
@click.option("--baselines", "source", default=None, help="store dir (default: lpdiff's store)")
@click.option(
    "--dry-run/--yes", default=True, show_default=True, help="list what would go (default), or remove it (--yes)"
)
def baselines_prune(source, dry_run) -> int:
    """Remove baselines superseded by a newer run of the same computation. Only files whose content matches their
    key are removed or count as newer; every other file is listed and kept. The only command that deletes from a
    store; it lists every file it will remove before it removes any."""
    from lpdiff.harness.pipeline.references import default_store

    store = default_store(source)
    plan = store.prune(dry_run=True)
    for e in plan:
        click.echo(f"{'would remove' if dry_run else 'will remove'} {e.path}  {e.describe()}")
    for e in store.scan()[1]:
        click.echo(
            f"kept (not a baseline whose content matches its key; remove it by hand if it is not yours to "
            f"keep) {e.path}: {e.problem}"
        )
    if dry_run:
        log(f"{len(plan)} file(s) would be removed from {store.root}; `lpdiff baselines prune --yes` removes them")
        return 0
    changed = store.remove(plan)
    for e in changed:
        click.echo(f"kept (changed since it was listed) {e.path}")
    log(f"{len(plan) - len(changed)} file(s) were removed from {store.root}")
    return 0


@baselines.command("pull")
@click.argument("source")
@click.option("--lock", default="baselines.lock", show_default=True, help="lock file pinning the revision")
@click.option("--update-lock/--no-update-lock", default=True, show_default=True)
def baselines_pull(source, lock, update_lock) -> int:
    """Fetch a Hub dataset revision into the HF cache (checked file by file) and pin it in the lock file."""
    from lpdiff.harness.pipeline import hub

    pulled = hub.pull(source, lock=lock, update_lock=update_lock)
    click.echo(f"{pulled.ref.url} -> {pulled.path}")
    return 0


@baselines.command("push")
@click.argument("target")
@click.option("--baselines", "source", default=None, help="local store to push (default: lpdiff's store)")
@click.option("--lock", default="baselines.lock", show_default=True)
@click.option("--message", default="lpdiff: update baselines", show_default=True)
@click.option(
    "--delete",
    is_flag=True,
    help="also remove Hub files this store lacks (only when the Hub is still at the lock's revision)",
)
def baselines_push(target, source, lock, message, delete) -> int:
    """Add a local store's baselines to a Hub dataset in one commit on top of its head: files pushed by others
    since the locked revision are kept (a file changed on both sides is refused), nothing is deleted without
    --delete, and only baselines whose content matches their key are uploaded (any other file refuses the push)."""
    from lpdiff.harness.pipeline import hub
    from lpdiff.harness.pipeline.references import default_store

    pushed = hub.push(default_store(source).root, target, lock=lock, message=message, delete=delete)
    for rel in pushed.deleted:
        click.echo(f"deleted {rel}")
    click.echo(f"{pushed.ref.url}: {len(pushed.added)} added or changed, {len(pushed.deleted)} deleted")
    return 0


@baselines.command("diff")
@click.argument("repo")
@click.argument("rev1")
@click.argument("rev2")
def baselines_diff(repo, rev1, rev2) -> int:
    """Entries added, removed and changed between two revisions of a Hub dataset."""
    from lpdiff.harness.pipeline import hub

    d = hub.diff(repo, rev1, rev2)
    for label, names in (("added", d.added), ("removed", d.removed), ("changed", d.changed)):
        for n in names:
            click.echo(f"{label:8s} {n}")
    log(f"{len(d.added)} added, {len(d.removed)} removed, {len(d.changed)} changed")
    return 0


@click.command()
@click.argument("json_paths", nargs=-1, required=True)
@click.option("-o", "--out", default="report.html", show_default=True)
def report(json_paths, out) -> int:
    """One self-contained HTML page from verdict JSON files (several nights: k2 over time)."""
    from lpdiff.harness.pipeline.html_report import write_report

    click.echo(f"wrote {write_report(list(json_paths), out)}")
    return 0
