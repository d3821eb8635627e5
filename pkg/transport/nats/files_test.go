package nats

import (
	"flag"
	"path/filepath"
	"testing"

	"github.com/fifobox/fifobox/internal/topologyfiles"
)

var updateTopologies = flag.Bool("update-topologies", false, "rewrite topologies/nats/*.json from the built-in examples")

// The JSON files under topologies/nats are the built-in examples as data:
// what infra's CDK context reads and passes to the functions, and what
// operators copy to start their own.
func TestTopologyFilesMatchExamples(t *testing.T) {
	topologyfiles.Check(t, filepath.Join("..", "..", "..", "topologies", "nats"),
		map[string]func() Topology{"holdco": Holdco, "ticketing": Ticketing, "corewrite": Corewrite},
		LoadTopology, *updateTopologies)
}
