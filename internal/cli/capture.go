package cli

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/fifobox/fifobox/pkg/capture"
	"github.com/fifobox/fifobox/pkg/wire"
)

func (a *app) captureCmd() *cobra.Command {
	var profile, schema string
	var uninstall bool
	c := &cobra.Command{
		Use:   "capture",
		Short: "Deliver what a system's producers write to their own outbox table (a profile's source section): checks the mapping, then installs its triggers; idempotent",
		Long: `Makes fifobox deliver the rows a system's producers already write to their own outbox
table, without changing them: the profile's source section (docs/wire-profiles.md)
says where each event field is in a row. The command checks it against the database
first (the table, each column and its type, a unique event id) and refuses, naming
the profile field, anything that would not deliver; then, in one transaction, it
installs an insert trigger on that table that enqueues each new row into fifobox's
outbox, and, with a status section, a trigger that keeps the table's status columns
true. Run it as the owner of the producers' table, a member of fifobox_producer (the triggers
run with the installer's rights, which it checks), connected with that table on the search_path
and fifobox's schema given by --fifobox-schema. --uninstall removes the triggers.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if a.viaLambda != "" {
				return errNoLocal
			}
			if profile == "" {
				return errors.New("capture: --profile is required (a built-in name, a JSON file, or the JSON itself)")
			}
			p, err := wire.Load(profile)
			if err != nil {
				return fmt.Errorf("capture: --profile: %w", err)
			}
			if p.Source == nil {
				return fmt.Errorf("capture: --profile: profile %s has no source section (the producers' table to deliver from)", p.Name)
			}
			pool, err := a.connect(cmd.Context())
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 2*time.Minute)
			defer cancel()
			cfg := capture.InstallConfig{Schema: schema}
			if uninstall {
				if err := capture.Uninstall(ctx, pool, p, cfg); err != nil {
					return err
				}
				fmt.Fprintf(a.out, "capture of profile %s removed from %s\n", p.Name, p.Source.Table)
				return nil
			}
			inst, err := capture.Install(ctx, pool, p, cfg)
			if err != nil {
				return err
			}
			fmt.Fprintf(a.out, "capture installed: profile %s delivers every row inserted into %s (trigger %s)\n", p.Name, inst.Table.Ident(), inst.Trigger)
			if inst.EventIDIndex != "" {
				fmt.Fprintf(a.out, "  event ids unique by index %s on %s\n", inst.EventIDIndex, p.Source.EventID)
			}
			if inst.StatusTrigger != "" {
				fmt.Fprintf(a.out, "  status columns follow each event (trigger %s on fifobox's outbox)\n", inst.StatusTrigger)
			}
			return nil
		},
	}
	c.Flags().StringVar(&profile, "profile", "", "the wire profile whose source section to install (env FIFOBOX_PROFILE)")
	c.Flags().StringVar(&schema, "fifobox-schema", "", "the schema fifobox is installed in (default: the connection's current schema)")
	c.Flags().BoolVar(&uninstall, "uninstall", false, "remove the capture's triggers instead")
	c.PreRun = func(*cobra.Command, []string) {
		if profile == "" {
			profile = wire.Env.Get(wire.EnvProfile)
		}
	}
	return c
}
