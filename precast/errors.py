"""The one exception type users see: it says what is wrong and what to do."""

import errno


class PrecastError(Exception):
    """A problem with the user's input (checkpoint, engine, flags), stated plainly.

    Raised instead of letting a KeyError or a numpy shape error escape, so the CLI
    can print the message without a traceback.
    """


# What to do about the operating-system errors a build or a load meets in practice.
_OS_ADVICE = {
    errno.ENOSPC: "free space there or choose another --output; an engine already at the output is untouched",
    errno.EDQUOT: "the disk quota is full: free space or choose another --output; an engine already at the output is untouched",
    errno.EROFS: "the filesystem is read-only: choose an --output on a writable one",
    errno.EACCES: "check the permissions of that path, or choose another",
    errno.EPERM: "check the permissions of that path, or choose another",
    errno.ENOENT: "check the path",
    errno.EIO: "the storage reported an I/O error: check the disk, then retry",
}


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: what failed, on which path, and what to do."""
    where = f" ({e.filename})" if e.filename else ""
    name = errno.errorcode.get(e.errno or 0, "")
    advice = _OS_ADVICE.get(e.errno or 0, "")
    return f"{e.strerror or e}{where}" + (f" [{name}]" if name else "") + (f"; {advice}" if advice else "")
