"""ds_config, parsed into typed sections."""
