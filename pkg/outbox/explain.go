package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// ClaimRowsReadPerEvent runs the claim query (outbox_claim_heads) under
// EXPLAIN ANALYZE in a transaction it rolls back, and returns how many outbox
// rows the plan read (returned or filtered out, over all loops) per claimed
// event. An efficient claim reads about one row per event however large the
// table and however many events wait behind blocked heads; a value near
// backlog/batch means every claim rescans the backlog. Used by benchmarks and
// `fifobox status --explain`-style diagnostics.
func ClaimRowsReadPerEvent(ctx context.Context, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, batch int) (float64, error) {
	return claimRowsReadPerEvent(ctx, db, batch)
}

func claimRowsReadPerEvent(ctx context.Context, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, batch int) (float64, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("explain claim: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // read-only diagnosis, always rolled back
	// EXPLAIN cannot see inside a function call: explain the function's query
	// under the function's own settings instead, as a prepared statement, so
	// that plan_cache_mode gives it the plan the function runs (generic since
	// migrations/00065).
	var src string
	var settings []string
	if err := tx.QueryRow(ctx, sqlClaimFunction).Scan(&src, &settings); err != nil {
		return 0, fmt.Errorf("explain claim: read outbox_claim_heads: %w", err)
	}
	for _, kv := range settings {
		name, value, _ := strings.Cut(kv, "=")
		if _, err := tx.Exec(ctx, "SELECT set_config($1, $2, true)", name, value); err != nil {
			return 0, fmt.Errorf("explain claim: apply %s: %w", kv, err)
		}
	}
	stmt := "fifobox_explain_claim_" + strings.ReplaceAll(uuid.NewString(), "-", "")
	if _, err := tx.Exec(ctx, "PREPARE "+stmt+"(integer, integer, uuid, bigint) AS "+claimQuery(src)); err != nil {
		return 0, fmt.Errorf("explain claim: prepare: %w", err)
	}
	var plan []byte
	// EXECUTE's arguments are literals: a utility statement takes no
	// parameters (they are numbers and a generated UUID).
	if err := tx.QueryRow(ctx, fmt.Sprintf("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE %s(%d, %d, '%s', 60000)",
		stmt, batch, batch, uuid.New())).Scan(&plan); err != nil {
		return 0, fmt.Errorf("explain claim: %w", err)
	}
	if _, err := tx.Exec(ctx, "DEALLOCATE "+stmt); err != nil {
		return 0, fmt.Errorf("explain claim: deallocate: %w", err)
	}
	var doc []struct {
		Plan planNode `json:"Plan"`
	}
	if err := json.Unmarshal(plan, &doc); err != nil || len(doc) == 0 {
		return 0, fmt.Errorf("explain claim: parse plan: %v", err)
	}
	claimed := doc[0].Plan.ActualRows // events (and any empty heads) returned
	var read float64
	var walk func(n planNode, top bool)
	walk = func(n planNode, top bool) {
		if n.Relation == "outbox" && !top {
			read += (n.ActualRows + n.RemovedByFilter + n.RemovedByIndex) * max(n.Loops, 1)
		}
		for _, c := range n.Plans {
			walk(c, false)
		}
	}
	walk(doc[0].Plan, true)
	if claimed == 0 {
		return 0, nil
	}
	return read / claimed, nil
}

// claimQuery is the query in outbox_claim_heads' source: since
// migrations/00065 a PL/pgSQL function whose query runs from RETURN QUERY to
// the last semicolon; before, a SQL function that was the query.
func claimQuery(src string) string {
	i := strings.Index(src, "RETURN QUERY")
	j := strings.LastIndex(src, ";")
	if i < 0 || j < i {
		return src
	}
	return src[i+len("RETURN QUERY") : j]
}

type planNode struct {
	NodeType        string     `json:"Node Type"`
	Relation        string     `json:"Relation Name"`
	ActualRows      float64    `json:"Actual Rows"`
	Loops           float64    `json:"Actual Loops"`
	RemovedByFilter float64    `json:"Rows Removed by Filter"`
	RemovedByIndex  float64    `json:"Rows Removed by Index Recheck"`
	Plans           []planNode `json:"Plans"`
}
