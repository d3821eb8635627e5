// Command infra is fifobox's CDK app (run by the CDK CLI through cdk.json).
//
//	cdk synth                      # <Prefix>-Stateful and <Prefix>-Stateless (offline)
//	cdk synth -c local=true        # <Prefix>-Local, for cdklocal (LocalStack/Floci)
//
// Context values are listed in stacks.FromContext.
package main

import (
	"fmt"
	"os"

	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/jsii-runtime-go"

	"github.com/fifobox/fifobox/infra/stacks"
)

func main() {
	defer jsii.Close()
	app := awscdk.NewApp(nil)
	cfg, err := stacks.FromContext(app.Node(), stacks.DefaultConfig())
	if err == nil {
		_, err = stacks.Build(app, cfg, stacks.ContextBool(app.Node(), "local"), env(cfg))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "fifobox infra:", err)
		jsii.Close()
		os.Exit(1)
	}
	app.Synth(nil)
}

// env pins account and region only when a VPC lookup needs them; otherwise the
// templates stay environment-agnostic and synthesise without AWS credentials.
func env(cfg stacks.Config) *awscdk.Environment {
	if cfg.VpcID == "" {
		return nil
	}
	return &awscdk.Environment{
		Account: jsii.String(os.Getenv("CDK_DEFAULT_ACCOUNT")),
		Region:  jsii.String(os.Getenv("CDK_DEFAULT_REGION")),
	}
}
