"""The lab: what each rank's device is, the process group (its rendezvous and its teardown), the groups the ranks
form, and the emulation of a mixed lab."""
