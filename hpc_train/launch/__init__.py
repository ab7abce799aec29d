"""How ranks are started on a node: the worker every path ends in, the script supervisor, the local launcher."""
