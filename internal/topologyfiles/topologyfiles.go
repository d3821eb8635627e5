// Package topologyfiles checks that the JSON topology files under
// topologies/<transport> stay equal to a transport's built-in examples
// (what infra's CDK context and operators read), and rewrites them on
// request.
package topologyfiles

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"sort"
	"testing"
)

// Check loads dir/<name>.json with load and compares it, as JSON with the
// defaults filled in by load, with load(name) (the built-in example). With
// update it first writes each example to its file.
func Check[T any](t *testing.T, dir string, examples map[string]func() T, load func(string) (T, error), update bool) {
	t.Helper()
	names := make([]string, 0, len(examples))
	for name := range examples {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		path := filepath.Join(dir, name+".json")
		if update {
			var buf bytes.Buffer
			enc := json.NewEncoder(&buf)
			enc.SetIndent("", "  ")
			if err := enc.Encode(examples[name]()); err != nil {
				t.Fatal(err)
			}
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		fromFile, err := load(path)
		if err != nil {
			t.Fatalf("%s: %v (go test -run TestTopologyFilesMatchExamples -update-topologies rewrites it)", path, err)
		}
		builtIn, err := load(name)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := json.Marshal(fromFile)
		want, _ := json.Marshal(builtIn)
		if !bytes.Equal(got, want) {
			t.Errorf("%s differs from the built-in %s topology: go test -run TestTopologyFilesMatchExamples -update-topologies", path, name)
		}
	}
}
