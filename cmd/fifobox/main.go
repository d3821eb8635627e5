// Command fifobox is the operator CLI: the redrive Lambda's operations
// (migrate, status, dead events, retry-now, DLQ list/peek/redrive/discard,
// release-holds, replay, prune, audit), the dispatcher and consumers as
// long-running processes, and provisioning. The commands live in
// internal/cli.
package main

import (
	"os"

	"github.com/fifobox/fifobox/internal/cli"
)

func main() { os.Exit(cli.Main()) }
