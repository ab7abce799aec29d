"""The command line: the parser and every command."""
