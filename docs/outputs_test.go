package docs

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/cli"
	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/pgtest"
)

// update rewrites the golden files from fresh output and the documented
// blocks from the golden files: `make docs`.
var update = os.Getenv("FIFOBOX_UPDATE_DOCS") == "1"

// producers make each documented output, as a user would see it.
var producers = map[string]func(t *testing.T, run *docRun) string{
	"fifobox-help":       func(t *testing.T, r *docRun) string { return r.help(t) },
	"status":             func(t *testing.T, r *docRun) string { return r.cli(t, "status") },
	"dlq-list":           func(t *testing.T, r *docRun) string { return r.cli(t, "dlq", "list", "--consumer", "shipping") },
	"retry-now-dry-run":  func(t *testing.T, r *docRun) string { return r.cli(t, "retry-now", "--dry-run") },
	"make-local":         func(t *testing.T, r *docRun) string { return r.local(t).tail },
	"make-local-summary": func(t *testing.T, r *docRun) string { return r.local(t).summary },
}

// docRun holds what the producers share: one scenario, one demo run.
type docRun struct {
	sc   *scenario
	demo *demoOutput
}

func (r *docRun) scenario(t *testing.T) *scenario {
	if r.sc == nil {
		r.sc = newScenario(t)
	}
	r.sc.setEnv(t)
	return r.sc
}

// cli runs the command (in process, as cmd/fifobox does) on the
// scenario and returns what it printed; stderr too when it failed.
func (r *docRun) cli(t *testing.T, args ...string) string {
	t.Helper()
	sc := r.scenario(t)
	var out, errOut bytes.Buffer
	err := cli.Run(context.Background(), &out, &errOut, args...)
	s := strings.ReplaceAll(out.String(), sc.prefix, "")
	if err != nil {
		s += errOut.String() + "fifobox: " + err.Error() + "\n"
	}
	return s
}

// help is `fifobox --help` in a shell with none of fifobox's variables
// set (the flags' defaults show them).
func (r *docRun) help(t *testing.T) string {
	t.Helper()
	for _, v := range []string{"FIFOBOX_DATABASE_URL", "FIFOBOX_QUEUES", "FIFOBOX_REDRIVE_FUNCTION"} {
		t.Setenv(v, "")
	}
	var out, errOut bytes.Buffer
	if err := cli.Run(context.Background(), &out, &errOut, "--help"); err != nil {
		t.Fatalf("fifobox --help: %v\n%s", err, errOut.String())
	}
	return out.String()
}

type demoOutput struct{ tail, summary string }

// local runs `make local`'s program as make local does, once, until it
// drains (-exit-when-drained), on the shared emulator under a prefix of
// its own.
func (r *docRun) local(t *testing.T) *demoOutput {
	t.Helper()
	if r.demo != nil {
		return r.demo
	}
	db := pgtest.NewEmpty(t)
	ep := emulatortest.Endpoint(t)
	prefix := "docs-" + strings.TrimPrefix(db.Schema, "t_") + "-"
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "run", "../cmd/fifobox-local", "-orders", "300", "-rate", "200", "-exit-when-drained",
		"-metrics-log", filepath.Join(t.TempDir(), "metrics.jsonl"))
	for _, kv := range os.Environ() {
		// Only this run's settings: not the scenario's topic or queues.
		if !strings.HasPrefix(kv, "FIFOBOX_") && !strings.HasPrefix(kv, "AWS_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "AWS_ENDPOINT_URL="+ep, "AWS_REGION=us-east-1", "AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test",
		"FIFOBOX_DATABASE_URL="+db.URL, "FIFOBOX_SNS_NAME_PREFIX="+prefix)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("make local: %v\n%s", err, out)
	}
	s := strings.ReplaceAll(string(out), prefix, "")
	lines := strings.Split(s, "\n")
	var last string
	for _, l := range lines {
		if strings.HasPrefix(l, "draining |") {
			last = l
		}
	}
	i := strings.Index(s, "\nsummary: ")
	if i < 0 || last == "" {
		t.Fatalf("make local printed no summary:\n%s", s)
	}
	summary := strings.TrimLeft(s[i:], "\n")
	r.demo = &demoOutput{tail: last + "\n\n" + summary, summary: summary}
	return r.demo
}

// Volatile parts of real output: timings, ids, times, audit numbers, how
// many times the local scheduler happened to fire. Everything else (the
// labels, the columns, the counts) must match the golden file exactly.
var volatile = []struct {
	re  *regexp.Regexp
	rep string
}{
	{regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`), "<uuid>"},
	{regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z`), "<time>"},
	// Go durations: 150ms, 7.192s, 1m6.17s (a slow machine), 1h0m0s.
	{regexp.MustCompile(`\b(\d+h)?(\d+m)?\d+(\.\d+)?(ms|µs|ns|s)\b`), "<duration>"},
	{regexp.MustCompile(`audit #\d+`), "audit #<n>"},
	{regexp.MustCompile(`\d+ invocations`), "<n> invocations"},
	{regexp.MustCompile(`(default "[^"@]*@)[^"]*"`), `${1}<host>"`},
	{regexp.MustCompile(`(?m)^(\s+--actor string\s+who is asking.*\(default ")[^"]*(")`), "${1}<user@host>$2"},
	// Columns padded to the width of a timing move with it.
	{regexp.MustCompile(`[ \t]+`), " "},
}

func normalize(s string) string {
	for _, v := range volatile {
		s = v.re.ReplaceAllString(s, v.rep)
	}
	return s
}

func goldenPath(name string) string { return filepath.Join("testdata", name+".txt") }

// Every documented output block is what the code prints: the block equals
// its golden file, and the golden file equals fresh output of the real
// command (up to timings and ids). `make docs` refreshes both.
func TestDocOutputs(t *testing.T) {
	for _, v := range []string{"FIFOBOX_DATABASE_URL", "FIFOBOX_QUEUES", "FIFOBOX_REDRIVE_FUNCTION", "FIFOBOX_TRANSPORT"} {
		t.Setenv(v, "")
	}
	t.Setenv("USER", "you")
	blocks := allBlocks(t)
	used := map[string]bool{}
	for _, b := range blocks {
		if b.marker == "output" {
			if producers[b.arg] == nil {
				t.Errorf("%s:%d: <!-- output: %s -->: no test produces it (producers in docs/outputs_test.go)", b.file, b.line, b.arg)
				continue
			}
			used[b.arg] = true
		}
	}
	run := &docRun{}
	var names []string
	for name := range used {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		fresh := producers[name](t, run)
		path := goldenPath(name)
		if update {
			if err := os.WriteFile(path, []byte(fresh), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		golden, err := os.ReadFile(path)
		if err != nil {
			t.Errorf("%s: %v (run make docs)", path, err)
			continue
		}
		if normalize(string(golden)) != normalize(fresh) {
			t.Errorf("%s differs from what the code prints now (run make docs, and check the change):\n--- golden\n%s\n--- now\n%s", path, golden, fresh)
		}
	}
	// The blocks themselves, rewritten from the golden files under make docs.
	edits := map[string][]block{}
	for _, b := range blocks {
		if b.marker != "output" || producers[b.arg] == nil {
			continue
		}
		golden, err := os.ReadFile(goldenPath(b.arg))
		if err != nil {
			continue
		}
		if update {
			if b.body != string(golden) {
				b.arg = string(golden)
				edits[b.file] = append(edits[b.file], b)
			}
			continue
		}
		if b.body != string(golden) {
			t.Errorf("%s:%d: the block differs from %s (run make docs)", b.file, b.line, goldenPath(b.arg))
		}
	}
	for file, bs := range edits {
		path := filepath.Join("..", file)
		md, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		s := string(md)
		for i := len(bs) - 1; i >= 0; i-- { // from the end: offsets stay valid
			s = s[:bs[i].start] + bs[i].arg + s[bs[i].end:]
		}
		if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(os.Stderr, "docs: rewrote %d blocks of %s\n", len(bs), file)
	}
}
