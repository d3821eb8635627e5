package docs

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/internal/emulatortest"
)

// The aws CLI lines of development.md run after `source localstack/env.sh`
// against the emulator (the v1 CLI, which ignores AWS_ENDPOINT_URL for SQS
// in us-east-1, included).
func TestEnvShPointsTheAWSCLIAtTheEmulator(t *testing.T) {
	if _, err := exec.LookPath("aws"); err != nil {
		t.Skip("no aws CLI on this machine")
	}
	ep := emulatortest.Endpoint(t)
	md, err := os.ReadFile("development.md")
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, b := range parseBlocks("docs/development.md", string(md)) {
		for _, l := range logicalLines(b.body) {
			if strings.HasPrefix(l, "aws ") {
				lines = append(lines, l)
			}
		}
	}
	if len(lines) < 2 {
		t.Fatalf("development.md shows %d aws lines", len(lines))
	}
	root, _ := filepath.Abs("..")
	for _, l := range lines {
		cmd := exec.Command("bash", "-c", "source localstack/env.sh && "+l)
		cmd.Dir = root
		var env []string
		for _, kv := range os.Environ() {
			if !strings.HasPrefix(kv, "AWS_") {
				env = append(env, kv)
			}
		}
		cmd.Env = append(env, "AWS_ENDPOINT_URL="+ep)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("%s: %v\n%s", l, err, out)
		}
	}
}
