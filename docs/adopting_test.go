package docs

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/internal/cli"
	"github.com/fifobox/fifobox/internal/pgtest"
)

// The adoption pages (docs/adopting-*.md) show `fifobox capture` installing
// each seed system's profile on its document's own outbox table.
func init() {
	for system, file := range map[string]string{"holdco": "outbox.sql", "corebilling": "outbox.sql", "corewrite": "outbox.sql",
		"ticketing": "outbox.sql", "transfers": "wire_test.sql"} {
		producers["capture-"+system] = func(t *testing.T, _ *docRun) string { return captureOutput(t, system, file) }
	}
	producers["capture-holdco-not-unique"] = func(t *testing.T, _ *docRun) string {
		return captureOutput(t, "holdco", "outbox.sql", `ALTER TABLE event_outbox DROP CONSTRAINT event_outbox_pkey`)
	}
}

// captureOutput creates the system's table from examples/seeds (then runs
// more, if given) in a schema where fifobox is installed and runs
// `fifobox capture --profile <system>` there, as its page shows it.
func captureOutput(t *testing.T, system, file string, more ...string) string {
	t.Helper()
	ctx := context.Background()
	fb := pgtest.New(t)       // fifobox, in a schema of its own
	app := pgtest.NewEmpty(t) // the producers' schema, their search_path
	ddl, err := os.ReadFile(filepath.Join("..", "examples", "seeds", system, file))
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range append([]string{string(ddl)}, more...) {
		if _, err := app.Pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", system, err)
		}
	}
	var out, errOut bytes.Buffer
	err = cli.Run(ctx, &out, &errOut, "--database-url", app.URL, "capture", "--profile", system, "--fifobox-schema", fb.Schema)
	s := "$ fifobox capture --profile " + system + " --fifobox-schema fifobox\n" + out.String()
	if err != nil {
		s += "fifobox: " + err.Error() + "\n"
	}
	return strings.NewReplacer(`"`+app.Schema+`".`, `"public".`, fb.Schema, "fifobox").Replace(s)
}
