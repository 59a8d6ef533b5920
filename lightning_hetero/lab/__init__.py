"""The lab: what each rank's device is, the groups the ranks form, and the emulation of a mixed lab."""
