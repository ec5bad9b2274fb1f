"""The RequestSource methods (common/engine/base.py) a script's own request set answers as a closed, fixed set
does: nothing more will come, nothing to wait for, no held caches, never cancelled. Scripts override what they test."""


class FixedSetSource:
    def open(self):
        return False

    def wait(self, timeout):
        return None

    def accepting(self):
        return True

    def released(self):
        return []

    def cancelled(self):
        return False
