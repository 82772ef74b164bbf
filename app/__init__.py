"""tokentop: the Textual dashboard and the command line."""
