"""One module per `stack` subcommand: thin adapters from CLI arguments to the stages."""
