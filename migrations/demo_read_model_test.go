package migrations_test

import (
	"context"
	"testing"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/readmodel"
)

// The demo's read model is not fifobox's: a fresh install has no
// orders_read_model; a deployment upgraded with rows in it keeps them,
// untouched; the demo creates its own with readmodel.Setup.
func TestDemoReadModelLeavesTheMigrations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	exists := func(db *pgtest.DB) bool {
		var ok bool
		if err := db.Pool.QueryRow(ctx, `SELECT to_regclass('orders_read_model') IS NOT NULL`).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}

	fresh := pgtest.NewEmpty(t)
	if err := migrations.Up(ctx, fresh.Pool); err != nil {
		t.Fatal(err)
	}
	if exists(fresh) {
		t.Errorf("a fresh install has the demo's orders_read_model")
	}
	for i := 0; i < 2; i++ { // idempotent
		if err := readmodel.Setup(ctx, fresh.Pool); err != nil {
			t.Fatal(err)
		}
	}
	if !exists(fresh) {
		t.Errorf("readmodel.Setup made no table")
	}

	old := pgtest.NewEmpty(t)
	if err := migrations.UpTo(ctx, old.Pool, 50); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Pool.Exec(ctx, `INSERT INTO orders_read_model (order_id, status, last_sequence, event_count) VALUES ('o-1', 'paid', 2, 2)`); err != nil {
		t.Fatal(err)
	}
	if err := migrations.Up(ctx, old.Pool); err != nil {
		t.Fatal(err)
	}
	var status string
	if err := old.Pool.QueryRow(ctx, `SELECT status FROM orders_read_model WHERE order_id = 'o-1'`).Scan(&status); err != nil || status != "paid" {
		t.Errorf("an upgraded deployment's read model row: %q, %v", status, err)
	}

	// An empty table something of the user's depends on stays too.
	dep := pgtest.NewEmpty(t)
	if err := migrations.UpTo(ctx, dep.Pool, 50); err != nil {
		t.Fatal(err)
	}
	if _, err := dep.Pool.Exec(ctx, `CREATE VIEW paid_orders AS SELECT order_id FROM orders_read_model WHERE status = 'paid'`); err != nil {
		t.Fatal(err)
	}
	if err := migrations.Up(ctx, dep.Pool); err != nil {
		t.Fatal(err)
	}
	if !exists(dep) {
		t.Errorf("the migration dropped a table a user's view depends on")
	}
}
