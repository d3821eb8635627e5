package natsbus

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"testing"
)

var updateTopologies = flag.Bool("update-topologies", false, "rewrite topologies/nats/*.json from the built-in examples")

// The JSON files under topologies/nats are the built-in examples as data:
// what infra (CDK context natsTopology) reads and passes to the
// functions, and what operators copy to start their own. They must load to
// exactly the built-in topology of the same name.
func TestTopologyFilesMatchExamples(t *testing.T) {
	examples := map[string]func() Topology{"holdco": Holdco, "ticketing": Ticketing, "corewrite": Corewrite}
	for name, example := range examples {
		path := filepath.Join("..", "..", "..", "topologies", "nats", name+".json")
		if *updateTopologies {
			var buf bytes.Buffer
			enc := json.NewEncoder(&buf)
			enc.SetIndent("", "  ")
			if err := enc.Encode(example()); err != nil {
				t.Fatal(err)
			}
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		fromFile, err := LoadTopology(path)
		if err != nil {
			t.Fatalf("%s: %v (go test -run TestTopologyFilesMatchExamples -update-topologies rewrites it)", path, err)
		}
		builtIn, err := LoadTopology(name)
		if err != nil {
			t.Fatal(err)
		}
		// Compared as JSON: the exported fields, defaults filled in by both.
		got, _ := json.Marshal(fromFile)
		want, _ := json.Marshal(builtIn)
		if !bytes.Equal(got, want) {
			t.Errorf("%s differs from the built-in %s topology: go test -run TestTopologyFilesMatchExamples -update-topologies", path, name)
		}
	}
}
