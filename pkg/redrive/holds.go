package redrive

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// releaseHolds deletes a consumer's inbox_held rows (all its groups, or the
// selected ones) in the transaction that writes the audit row. Only for
// holds whose dead-lettered messages will not come back: a message still in
// the DLQ and redriven after its group was released is applied after the
// group's later events.
func (s *Service) releaseHolds(ctx context.Context, cmd Command) (Result, error) {
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	if cmd.Consumer == "" {
		return res, fmt.Errorf("release-holds: %w", fieldErr("consumer", "required"))
	}
	groups := cmd.Groups
	if groups == nil {
		groups = []string{} // never NULL: cardinality(NULL) would match nothing
	}
	var n, g int64
	if err := s.db.QueryRow(ctx, sqlCountHeld, cmd.Consumer, groups).Scan(&n, &g); err != nil {
		return res, fmt.Errorf("release-holds: count: %w", err)
	}
	res.Affected, res.Aggregates = n, int(g)
	if n > int64(cmd.Max) {
		return res, fmt.Errorf("release-holds: %w", fieldErr("max", "%d held messages selected, more than %d: narrow the selection (groups) or raise it", n, cmd.Max))
	}
	if cmd.DryRun {
		res.Message = fmt.Sprintf("would release %d held groups (%d messages listed) of %s", g, n, cmd.Consumer)
		return res, nil
	}
	err := pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		id, err := s.auditStart(ctx, tx, cmd)
		if err != nil {
			return err
		}
		res.AuditID = id
		tag, err := tx.Exec(ctx, sqlDeleteHeld, cmd.Consumer, groups)
		if err != nil {
			return fmt.Errorf("delete held rows: %w", err)
		}
		res.Affected = tag.RowsAffected()
		_, err = tx.Exec(ctx, sqlAuditDone, id, res.Affected)
		return err
	})
	if err != nil {
		return res, fmt.Errorf("release-holds: %w", err)
	}
	res.Message = fmt.Sprintf("released %d held groups (%d messages listed) of %s", g, res.Affected, cmd.Consumer)
	s.log.Info("redrive operation finished", "audit_id", res.AuditID, "operation", cmd.Operation, "actor", cmd.Actor, "status", "done", "affected", res.Affected)
	return res, nil
}
