package seeds_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/capture"
)

// seeds/004's wire-test SQL, copied from the document, works as written in
// the user's default schema of a database where fifobox is installed the
// way fifobox's components connect (pkg/db: fifobox's schema first, then
// the user's): its CREATE TABLE IF NOT EXISTS outbox makes the user's own
// table, its insert lands there, fifobox's outbox is untouched, and once
// fifobox's capture is installed the same SQL's event reaches fifobox's
// outbox. Resolving the profile's unqualified table through fifobox's own
// search_path is refused, naming source.table.
func TestTransfersWireTestBesideFifobox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	user := pgtest.NewEmpty(t) // stands for public: the user's sessions see only it
	schema := user.Schema + "_fifobox"
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = fmt.Sprintf(`"%s", "$user", %s`, schema, user.Schema)
	fifobox, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = fifobox.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		fifobox.Close()
	})
	if err := migrations.Up(ctx, fifobox); err != nil {
		t.Fatal(err)
	}

	wireTest, err := os.ReadFile(filepath.Join(clientsDir(), "transfers", "wire_test.sql"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := user.Pool.Exec(ctx, string(wireTest)); err != nil {
		t.Fatalf("the document's wire-test SQL beside fifobox: %v", err)
	}
	var theirs, ours int
	if err := user.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE eventType = 'events.transfers.submitted.usdc'`).Scan(&theirs); err != nil || theirs != 1 {
		t.Fatalf("the user's outbox holds %d wire-test rows (%v), want 1", theirs, err)
	}
	if err := fifobox.QueryRow(ctx, `SELECT count(*) FROM outbox_events`).Scan(&ours); err != nil || ours != 0 {
		t.Fatalf("fifobox's outbox holds %d events (%v), want none before capture", ours, err)
	}

	prof := load(t, "transfers")
	if _, err := capture.Install(ctx, fifobox, prof, capture.InstallConfig{}); !errors.Is(err, capture.ErrSource) {
		t.Fatalf("capture of %q through fifobox's search_path: %v, want an ErrSource naming source.table", prof.Source.Table, err)
	}
	if _, err := capture.Install(ctx, user.Pool, prof, capture.InstallConfig{Schema: schema}); err != nil {
		t.Fatal(err)
	}
	if _, err := user.Pool.Exec(ctx, string(wireTest)); err != nil {
		t.Fatalf("the wire-test SQL with capture installed: %v", err)
	}
	if err := fifobox.QueryRow(ctx, `SELECT count(*) FROM outbox_events WHERE aggregate_id = 'tr_test_123'`).Scan(&ours); err != nil || ours != 1 {
		t.Fatalf("fifobox's outbox holds %d events of tr_test_123 (%v), want the one captured", ours, err)
	}
}
