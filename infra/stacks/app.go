package stacks

import (
	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/jsii-runtime-go"
	"github.com/cdklabs/cdk-nag-go/cdknag/v2"
)

// Stacks are the stacks one app holds: either the AWS pair or the local variant.
type Stacks struct {
	Stateful  *StatefulStack
	Stateless *StatelessStack
	Local     *LocalStack
}

// Build adds fifobox's stacks to app. local selects the emulator variant
// (<Prefix>-Local); otherwise <Prefix>-Stateful and <Prefix>-Stateless are
// created and checked with cdk-nag's AwsSolutions pack (findings are errors
// and warnings on the stacks, which fail `cdk synth`/`deploy`).
func Build(app awscdk.App, cfg Config, local bool, env *awscdk.Environment) (*Stacks, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Stacks{}
	tags := func(desc string) *awscdk.StackProps {
		return &awscdk.StackProps{
			Env:         env,
			Description: jsii.String(desc),
			Tags:        &map[string]*string{"project": jsii.String("fifobox")},
		}
	}
	if local {
		s.Local = NewLocalStack(app, cfg.Prefix+"-Local", tags("fifobox pipeline for LocalStack/Floci (no VPC, no Aurora)"), cfg)
		return s, nil
	}
	s.Stateful = NewStatefulStack(app, cfg.Prefix+"-Stateful", tags("fifobox network and database (VPC, Aurora Serverless v2, RDS Proxy)"), cfg)
	net := &Network{Vpc: s.Stateful.Vpc, Subnets: s.Stateful.Subnets, SecurityGroup: s.Stateful.FunctionSG, Proxy: s.Stateful.Proxy, Cluster: s.Stateful.Cluster}
	s.Stateless = NewStatelessStack(app, cfg.Prefix+"-Stateless", tags("fifobox pipeline (SNS FIFO, SQS FIFO, dispatcher, consumers, redrive, alarms)"), cfg, net)
	s.Stateless.AddStackDependency(s.Stateful.Stack, jsii.String("functions use the VPC and the database proxy"))
	for _, st := range []awscdk.Stack{s.Stateful.Stack, s.Stateless.Stack} {
		awscdk.Aspects_Of(st).Add(cdknag.NewAwsSolutionsChecks(&cdknag.NagPackProps{Verbose: jsii.Bool(true)}), nil)
	}
	return s, nil
}
